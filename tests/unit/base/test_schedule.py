"""Learning-rate schedules: the factor of each update; one schedule over every optimizer of a sketch run (the sketch
optimizer and the AdamW of train_rest), of the dense baseline and of a Fabric run; held on skipped updates; logged
as train/lr; continued exactly by a resumed run."""

import math
from functools import partial

import pytest
from lightning.fabric import Fabric

from conftest import SKETCH_TARGETS, make_tiny_qwen2
from lightning_logra.base.schedule import LRSchedule
from lightning_logra.sketch import SketchAdam
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.strategies.fabric import SketchFabricStrategy


def test_factor_warms_up_linearly_then_decays_to_the_floor():
    # Warm-up over 4 updates: (i + 1) / 4. Cosine from update 4 to 8: 0.1 + 0.9·½(1 + cos(π·(i − 4)/4)); then 0.1.
    cosine = LRSchedule(warmup_steps=4, decay="cosine", total_steps=8, min_lr_ratio=0.1)
    half_cos = [0.5 * (1 + math.cos(math.pi * p / 4)) for p in range(4)]  # 1, 0.8536, 0.5, 0.1464
    expected = [0.25, 0.5, 0.75, 1.0] + [0.1 + 0.9 * h for h in half_cos] + [0.1, 0.1]
    assert [cosine.factor(i) for i in range(10)] == pytest.approx(expected, abs=1e-12)
    # Linear from the first update to 4, down to 0: 1, 3/4, 1/2, 1/4, 0, 0.
    linear = LRSchedule(decay="linear", total_steps=4)
    assert [linear.factor(i) for i in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert [LRSchedule(warmup_steps=2).factor(i) for i in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert [LRSchedule().factor(i) for i in range(3)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(warmup_steps=-1), "lr_schedule.warmup_steps must be a number of updates ≥ 0, got -1"),
    (dict(decay="cosine"), "lr_schedule.total_steps: decay 'cosine' needs the update at which it reaches its floor"),
    (dict(warmup_steps=5, decay="linear", total_steps=5), "larger than warmup_steps=5"),
    (dict(min_lr_ratio=1.5), "lr_schedule.min_lr_ratio must be in [0, 1], got 1.5"),
    (dict(decay="step"), "lr_schedule.decay must be constant, linear or cosine, got 'step'"),
])
def test_bad_schedules_are_refused_naming_the_setting(kwargs, message):
    with pytest.raises(ValueError) as info:
        LRSchedule(**kwargs)
    assert message in str(info.value)


def test_fabric_gets_one_scheduler_per_optimizer():
    config = SketchConfig(SKETCH_TARGETS, rank=4, optimizer=partial(SketchAdam, lr=1e-2), train_rest=True,
                          rest_lr=1e-3, lr_schedule=LRSchedule(warmup_steps=4))
    fabric = Fabric(accelerator="cpu", devices=1, strategy=SketchFabricStrategy(config))
    fabric.setup(make_tiny_qwen2())
    optimizers = fabric.setup_optimizers(*fabric.strategy.optimizers)
    assert [o.param_groups[0]["lr"] for o in optimizers] == [pytest.approx(2.5e-3), pytest.approx(2.5e-4)]
    for scheduler in fabric.strategy.lr_schedulers:
        scheduler.step()
    assert [o.param_groups[0]["lr"] for o in optimizers] == [pytest.approx(5e-3), pytest.approx(5e-4)]

"""Golden steps: three training steps of the shipped tiny model through the CLI, compared with recorded numbers.

Any numerical change to the step — sampling, reward, advantages, loss weights, micro-batching, the sketch, the
optimizer, the KL control, the merge — moves at least one of these numbers. When a change is intended, rerun with
GOLDEN_PRINT=1, check the new values make sense, and paste them here with the reason in the commit message.
"""

import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from cli import main

ROOT = Path(__file__).parents[1]
RECORDED = ("train/loss", "train/grad_norm", "train/reward_mean", "kl/q", "kl/alpha")


class Recorder(Callback):
    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    def on_fit_start(self, trainer, pl_module):
        self.start = {n: p.detach().double().clone() for n, p in pl_module.policy.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k in RECORDED})

    def on_fit_end(self, trainer, pl_module):
        # Checksums of what the steps did to the weights: a weighted sum (sensitive to where the change went)
        # and the norm of the whole change.
        delta_sum = delta_sq = 0.0
        for name, p in pl_module.policy.named_parameters():
            if name in self.start:
                delta = p.detach().double() - self.start[name]
                weights = torch.arange(1, delta.numel() + 1, dtype=torch.float64).view_as(delta) / delta.numel()
                delta_sum += float((delta * weights).sum())
                delta_sq += float((delta**2).sum())
        self.checksum = {"delta_weighted_sum": delta_sum, "delta_norm": delta_sq**0.5}


GOLDEN = {
    "tiny_arith": {
        "steps": [
            {"kl/q": 0.24068625271320343, "kl/alpha": 0.1441316455602646, "train/reward_mean": 0.484375,
             "train/loss": -0.1712203025817871, "train/grad_norm": 2.8450350761413574},
            {"kl/q": 0.0860910713672638, "kl/alpha": 0.2408331334590912, "train/reward_mean": 0.3125,
             "train/loss": -0.18735390901565552, "train/grad_norm": 1.6494370698928833},
            {"kl/q": 0.07919370383024216, "kl/alpha": 0.2509341835975647, "train/reward_mean": 0.25,
             "train/loss": -0.1372179388999939, "train/grad_norm": 2.072599172592163},
        ],
        "delta_weighted_sum": -0.10600780263972033,
        "delta_norm": 0.3772814889759997,
    },
    "tiny_arith_dense": {
        "steps": [
            {"train/reward_mean": 0.484375, "train/loss": -0.1712203025817871, "train/grad_norm": 3.911797046661377},
            {"train/reward_mean": 0.296875, "train/loss": -0.18954353034496307, "train/grad_norm": 2.1808760166168213},
            {"train/reward_mean": 0.171875, "train/loss": -0.060672055929899216, "train/grad_norm": 3.922102212905884},
        ],
        "delta_weighted_sum": 0.11982330292310503,
        "delta_norm": 0.17475697707073712,
    },
}


def _run(config: str, tmp_path) -> Recorder:
    recorder = Recorder()
    cli = main(["--config", str(ROOT / "configs" / f"{config}.yaml"), "--trainer.max_steps", "3",
                "--trainer.logger", "false",
                "--trainer.enable_progress_bar",
                "false", "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(tmp_path),
                "--data.init_args.batch_size", "8", "--trainer.val_check_interval", "1000"], run=False)
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    return recorder


@pytest.mark.parametrize("config", sorted(GOLDEN))
def test_three_steps_match_the_recorded_numbers(config, tmp_path):
    recorder = _run(config, tmp_path)
    observed = {"steps": recorder.metrics, **recorder.checksum}
    if os.environ.get("GOLDEN_PRINT"):
        print(f"\n{config!r}: {observed!r},")
    expected = GOLDEN[config]
    assert len(observed["steps"]) == len(expected["steps"]) == 3
    for step, (got, want) in enumerate(zip(observed["steps"], expected["steps"])):
        assert got.keys() == want.keys(), step
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), (step, key)
    for key in ("delta_weighted_sum", "delta_norm"):
        assert observed[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-12), key

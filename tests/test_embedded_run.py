"""The embedded default, run exactly as a user runs it: it must learn (timings go in the issue note, not here)."""

import glob
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cli import main

ROOT = Path(__file__).parents[1]


def test_tiny_arith_learns(tmp_path):
    cli = main(["fit", "--config", str(ROOT / "configs" / "tiny_arith.yaml"),
                "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"])
    steps = cli.trainer.global_step
    events = EventAccumulator(glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    rewards = [e.value for e in events.Scalars("train/reward_mean")]
    assert len(rewards) == steps
    tenth = steps // 10
    first, last = sum(rewards[:tenth]) / tenth, sum(rewards[-tenth:]) / tenth
    print(f"reward first tenth {first:.3f} → last tenth {last:.3f} over {steps} steps")
    assert last - first >= 0.2
    for name in ("train/loss", "train/grad_norm", "train/tokens_per_s", "val/pass@1", "kl/q", "kl/alpha",
                 "kl/realized"):
        assert events.Scalars(name), name
    # the predicted-KL controller kept every update inside its (annealed) budget
    predicted, budget = events.Scalars("kl/predicted"), events.Scalars("kl/budget")
    assert len(predicted) == steps
    assert all(p.value <= b.value * (1 + 1e-6) for p, b in zip(predicted, budget))
    assert budget[0].value > budget[-1].value

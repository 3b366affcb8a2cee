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
    for name in ("train/loss", "train/grad_norm", "train/tokens_per_s", "val/pass@1"):
        assert events.Scalars(name), name

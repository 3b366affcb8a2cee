"""What a run shows while it works: a bar that counts optimizer steps, and log lines around the long waits."""

import json
import logging

import pytest

from lightning_logra.base.waits import waiting_for
from lightning_logra.callbacks import StepProgressBar
from lightning_logra.data.prompts import PromptDataset


def _fit(run_cli, root, steps: int, *extra: str):
    """A tiny run with the progress bar back on, and no validation."""
    return run_cli("tiny_arith", "--trainer.enable_progress_bar", "true", "--trainer.val_check_interval", "100",
                   *extra, steps=steps, root=root)


@pytest.mark.integration
def test_the_bar_counts_steps_against_max_steps_resumed_runs_included(run_cli, tmp_path, capsys):
    first = _fit(run_cli, tmp_path, 2)
    bar = first.trainer.progress_bar_callback
    assert isinstance(bar, StepProgressBar)
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (2, 2)
    shown = capsys.readouterr().out  # Lightning's TQDM bars write to stdout
    assert "step 2/2 100%" in shown and "Epoch 0/-2" not in shown  # Lightning's bars: "Epoch 0/-2", 2 of 2 left

    checkpoint = next(tmp_path.glob("**/last.ckpt"))
    resumed = _fit(run_cli, tmp_path, 4, "--ckpt_path", str(checkpoint))
    bar = resumed.trainer.progress_bar_callback.train_progress_bar
    assert (bar.initial, bar.n, bar.total) == (2, 4, 4)  # it starts at the resumed step, and rates count this run's
    assert "step 4/4 100%" in capsys.readouterr().out


def test_a_wait_is_announced_and_its_duration_logged(caplog):
    log = logging.getLogger("lightning_logra.test")
    with caplog.at_level(logging.INFO, logger="lightning_logra"):
        with waiting_for("starting the engine", log):
            assert [r.getMessage() for r in caplog.records] == ["starting the engine ..."]  # before the wait ends
        with pytest.raises(RuntimeError), waiting_for("loading the model", log):
            raise RuntimeError("no such model")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[1].startswith("starting the engine: done in ") and messages[1].endswith(" s")
    assert messages[2] == "loading the model ..."
    assert messages[3].startswith("loading the model: failed after ")


def test_loading_prompts_is_announced(tmp_path, caplog):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(3)))
    with caplog.at_level(logging.INFO, logger="lightning_logra"):
        PromptDataset(str(path))
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == f"loading prompts for data.train from {path} ..."
    assert messages[1].startswith(f"loading prompts for data.train from {path}: done in ")

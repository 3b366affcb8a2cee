"""SIGTERM / SIGUSR1: the step in progress ends, a checkpoint of it is saved where `--ckpt_path` finds it, and the
run exits with 128 + the signal's number, every rank at the same step (callbacks/signals.py)."""

import glob
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

SAVED = re.compile(r"(SIG\w+): saved a checkpoint of step (\d+) to (\S+); exiting with status (\d+)\. "
                   r"Resume with --ckpt_path (\S+)")


def _run(run_cli, config, root, steps, *extra, **how):
    """A tiny run (conftest's run_cli) validating only at its end, its reward computed in the trainer's process (no
    reward process to start)."""
    return run_cli(config, "--trainer.val_check_interval", str(steps), "--model.scoring.timeout_s", "null", *extra,
                   steps=steps, root=root, **how)


@pytest.fixture
def one_thread():
    """Runs in this process on one thread, as the subprocesses below (OMP_NUM_THREADS=1): on a shared 2-core machine
    a run's two threads spend most of their time waiting for each other (10 s against 1 s here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _raise(when: str, step: int = 0) -> str:
    return '--trainer.callbacks+={"class_path": "conftest.RaiseSignal", "init_args": ' \
           f'{{"when": "{when}", "step": {step}}}}}'


@pytest.mark.parametrize("when, step, max_steps, saved", [
    ("validation", 2, 10, 3),  # the validation after step 2: saved at the end of step 3
    ("step", 3, 10, 4),  # step 4, after which a validation is due: saved, then the validation is skipped
    ("step", 2, 3, 3),  # the last step: saved, and the run exits 138 where it would have finished
], ids=["in a validation", "before a validation", "in the last step"])
def test_a_signal_in_this_process_saves_at_the_next_step_end(run_cli, tmp_path, caplog, one_thread, when, step,
                                                             max_steps, saved):
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    with pytest.raises(SystemExit) as info:
        _run(run_cli, "tiny_arith", tmp_path, max_steps, "--trainer.val_check_interval", "2", _raise(when, step))
    assert info.value.code == 128 + signal.SIGUSR1 == 138
    line = SAVED.search(caplog.text)
    assert line and line.group(1, 2, 4) == ("SIGUSR1", str(saved), "138")
    path = line.group(3)
    assert line.group(5) == path and path.endswith(os.path.join("version_0", "checkpoints", "last.ckpt"))
    assert torch.load(path, weights_only=False)["global_step"] == saved
    events = EventAccumulator(glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    assert len(events.Scalars("train/loss")) == saved  # the saved step's metrics too
    assert len(events.Scalars("val/pass@1")) == (saved - 1) // 2  # every 2 steps, none after the saved one
    assert {signum: signal.getsignal(signum) for signum in before} == before  # nothing of the run is left behind


def test_a_signal_in_the_sanity_check_exits_before_the_first_step_without_a_checkpoint(run_cli, tmp_path, caplog,
                                                                                        one_thread):
    with pytest.raises(SystemExit) as info:
        _run(run_cli, "tiny_arith", tmp_path, 10, "--trainer.num_sanity_val_steps", "1", _raise("sanity check"))
    assert info.value.code == 138
    assert "SIGUSR1 before the first training step of this run: nothing new to save, exiting with status 138 " \
           "without a checkpoint" in caplog.text
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)


def _start(run_cli, config: str, root: Path, steps: int, *extra: str) -> subprocess.Popen:
    """`python cli.py fit` in the background, its output in `root/out.log`; conftest.StepMarks marks each step."""
    return _run(run_cli, config, root, steps, *extra, "--trainer.callbacks+=conftest.StepMarks", subprocess=True,
                wait=False)


def _mark(root: Path, rank: int) -> tuple[int, int] | None:
    """(global step, process id) of the rank's last finished step, as conftest.StepMarks wrote it."""
    path = root / f"step.rank{rank}"
    if not path.exists():
        return None
    step, pid = path.read_text().split()
    return int(step), int(pid)


def _wait_for_step(run: subprocess.Popen, root: Path, ranks: int, step: int) -> list[int]:
    """Polls until every rank has finished `step` steps; returns their process ids."""
    deadline = time.monotonic() + 300
    while True:
        marks = [_mark(root, rank) for rank in range(ranks)]
        if all(mark is not None and mark[0] >= step for mark in marks):
            return [pid for _, pid in marks]
        assert run.poll() is None, (root / "out.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)


def _stopped(run: subprocess.Popen, root: Path, status: int) -> tuple[int, str, str]:
    """Waits for the signalled run; returns (its step, the checkpoint path, the log line's signal)."""
    assert run.wait(timeout=300) == status, (root / "out.log").read_text()[-3000:]
    saved = SAVED.search((root / "out.log").read_text())
    assert saved and int(saved.group(4)) == status and saved.group(5) == saved.group(3)
    return int(saved.group(2)), saved.group(3), saved.group(1)


def _state(root: Path) -> dict:
    path, = glob.glob(str(root / "**" / "checkpoints" / "last.ckpt"), recursive=True)  # not latest/
    return torch.load(path, weights_only=False)


def _assert_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}/{i}")
    else:
        assert a == b, where


@pytest.mark.long  # three runs in processes of their own, about 30 s
def test_sigterm_saves_the_step_exits_143_and_a_resume_equals_an_uninterrupted_run(run_cli, tmp_path):
    steps = 8  # the uninterrupted run; the signalled one stops at about step 3 (asserted below)
    straight = _start(run_cli, "tiny_arith", tmp_path / "straight", steps)  # beside it: one core each
    run = _start(run_cli, "tiny_arith", tmp_path / "stopped", 200)
    _wait_for_step(run, tmp_path / "stopped", ranks=1, step=2)
    run.send_signal(signal.SIGTERM)
    step, path, name = _stopped(run, tmp_path / "stopped", 143)
    assert name == "SIGTERM" and 2 <= step < steps
    assert _mark(tmp_path / "stopped", 0)[0] == step  # no step after the saved one
    assert torch.load(path, weights_only=False)["global_step"] == step
    # the saved step's metrics reached the logger before the exit
    events = EventAccumulator(glob.glob(str(tmp_path / "stopped" / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    assert len(events.Scalars("train/loss")) == step

    assert straight.wait(timeout=300) == 0, (tmp_path / "straight" / "out.log").read_text()[-3000:]
    resumed = _start(run_cli, "tiny_arith", tmp_path / "resumed", steps, "--ckpt_path", path)
    assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed" / "out.log").read_text()[-3000:]
    a, b = _state(tmp_path / "straight"), _state(tmp_path / "resumed")
    assert a["global_step"] == b["global_step"] == steps
    _assert_equal(a["state_dict"], b["state_dict"])  # every policy weight
    _assert_equal(a["optimizer_states"], b["optimizer_states"])  # and the sketch optimizer's state
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert any(not torch.equal(saved[n], a["state_dict"][n]) for n in saved)  # the resumed steps changed something


@pytest.mark.long  # a 2-process run, about 25 s
def test_sigusr1_to_one_rank_stops_both_ranks_at_the_same_step(run_cli, tmp_path):
    run = _start(run_cli, "tiny_arith_ddp", tmp_path, 200)
    _, other = _wait_for_step(run, tmp_path, ranks=2, step=2)
    os.kill(other, signal.SIGUSR1)  # rank 1 only, which rank 0 started: rank 0 hears of it through the agreement
    step, path, name = _stopped(run, tmp_path, 138)
    assert name == "SIGUSR1"
    assert [_mark(tmp_path, rank)[0] for rank in (0, 1)] == [step, step]
    assert [(tmp_path / f"exit.rank{rank}").read_text() for rank in (0, 1)] == ["138", "138"]
    with pytest.raises(ProcessLookupError):
        os.kill(other, 0)  # rank 0 waited for rank 1 before it exited itself
    assert torch.load(path, weights_only=False)["global_step"] == step

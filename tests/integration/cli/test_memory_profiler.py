"""MemoryProfiler: per-step average and peak memory, the footprint by category, and the table at the end of fit."""

import gc
import logging
import resource
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_logra.callbacks import MemoryProfiler
from lightning_logra.callbacks.memory import GIB, StepSampler, process_rss_reader
from lightning_logra.rollout import HFEngine
from lightning_logra.sketch.memory import memory_breakdown

MB = 10**6


def _profiler(trainer) -> MemoryProfiler:
    (profiler,) = [c for c in trainer.callbacks if isinstance(c, MemoryProfiler)]
    return profiler


def test_every_step_logs_average_and_peak_of_the_process_rss(run_cli):
    # Linux: writing 5 to clear_refs resets the kernel's RSS high-water mark, which ru_maxrss reports, to the current
    # RSS; afterwards ru_maxrss is the process's max RSS over this fit rather than over all the tests before it.
    Path("/proc/self/clear_refs").write_text("5")
    cli = run_cli("tiny_arith", steps=3)
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # KiB on Linux
    steps = _profiler(cli.trainer).steps
    assert len(steps) == 3
    for average, peak in steps:
        # The kernel sums its per-CPU RSS counters approximately and moves the high-water mark lazily (at unmap,
        # not at every page freed), so a sample may pass it by a few pages: 1% of slack.
        assert 0 < average <= peak <= 1.01 * max_rss
    # A step holds the whole process (libraries, model, optimizer), so its peak is close to the fit's.
    assert max(peak for _, peak in steps) > 0.9 * max_rss
    # every step reached TensorBoard, with the numbers the callback kept
    events = EventAccumulator(cli.trainer.logger.log_dir)
    events.Reload()
    for column, name in enumerate(("memory/avg_gib", "memory/peak_gib")):
        logged = [event.value for event in events.Scalars(name)]
        assert logged == pytest.approx([step[column] for step in steps], rel=1e-6)  # float32 in the event file
    # a CPU run has no device counter, and the in-process engine reports no memory of its own
    assert "memory/device_used_gib" not in cli.trainer.callback_metrics
    assert "memory/engine_gib" not in cli.trainer.callback_metrics
    # where the peak comes from: each part of the step's highest memory above the start, the highest of them the
    # step's peak (the parts cover the step); what the process held at the start, by what loaded it
    profiler = _profiler(cli.trainer)
    parts = {name: [event.value for event in events.Scalars(name)] for name in events.Tags()["scalars"]
             if name.startswith("memory/step/")}
    assert sorted(parts) == [f"memory/step/{part}_gib" for part in ("other", "score", "sync", "update", "wait")]
    start = profiler._at_start / GIB
    for index, (_, peak) in enumerate(steps):
        assert start + max(values[index] for values in parts.values()) == pytest.approx(peak, rel=1e-6)
    account = profiler.setup_account
    assert account["engine"] == 0  # the in-process engine is the policy: nothing started
    assert 0 < account["libraries"] < start
    assert account["libraries"] + profiler.breakdown.weights / GIB + account["rest"] == pytest.approx(start)


def test_the_samples_of_each_part_of_a_step():
    sampler = StepSampler(lambda: 0)
    sampler._samples = [(0.0, 5), (1.0, 7), (2.0, 3), (3.0, 9), (3.5, 1), (4.0, 2), (5.0, 4)]
    # wait until 1, score until 2, wait again until 3, update until 4; then the rest
    assert sampler.peaks([("wait", 1.0), ("score", 2.0), ("wait", 3.0), ("update", 4.0)]) == {
        "wait": 9, "score": 3, "update": 2, "other": 4}


def _window(spike_bytes: int) -> tuple[float, int]:
    """(average, peak) RSS of a 0.3 s step-like window that holds `spike_bytes` for 0.1 s in its middle."""
    sampler = StepSampler(process_rss_reader(), interval_s=0.005)
    sampler.start()
    time.sleep(0.1)
    spike = torch.ones(spike_bytes // 4)  # written, so every page of it is resident
    time.sleep(0.1)
    del spike  # a large block goes back to the system at once
    time.sleep(0.1)
    return sampler.stop()


def test_sampler_sees_a_spike_inside_the_step():
    # The process's RSS settles first (garbage of earlier tests collected, freed memory handed back), so that the
    # quiet window's level is the spike window's baseline (in a full test session the two differed by 64 MB).
    gc.collect()
    _window(0)
    quiet_average, quiet_peak = _window(0)
    spike_average, spike_peak = _window(400 * MB)
    assert 0.9 * 400 * MB < spike_peak - quiet_peak < 1.1 * 400 * MB
    # resident for only part of the window (while it is written, then 0.1 s), it lifts the average by less
    assert 0.1 * 400 * MB < spike_average - quiet_average < 0.6 * 400 * MB


@pytest.mark.parametrize("config", ["tiny_arith", "tiny_arith_dense_all"])
def test_the_breakdown_logged_is_the_runs(run_cli, config):
    cli = run_cli(config)
    expected = memory_breakdown(cli.model.policy, cli.trainer.optimizers)
    assert _profiler(cli.trainer).breakdown == expected
    metrics = cli.trainer.callback_metrics
    for name, size in expected.as_dict().items():  # every category, the total and dense_equivalent_gradients
        assert float(metrics[f"memory/{name}_gib"]) == pytest.approx(size / GIB, rel=1e-6)
    if config == "tiny_arith":
        assert expected.sketch_optimizer_state == 2 * expected.sketches > 0  # sketch Adam: m and v, d×r each
    else:
        # AdamW creates its state in its first step: measured after that step, it is counted
        assert expected.dense_optimizer_state > 2 * expected.dense_gradients > 0


def test_a_table_is_printed_at_the_end_of_fit(run_cli, caplog, monkeypatch):
    # lightning.pytorch's logger does not propagate to the root, where caplog listens (pytest 9 also hooks its
    # handlers onto that logger, older versions do not): let it propagate, and count each message once.
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        cli = run_cli("tiny_arith")
    (table,) = {r.getMessage() for r in caplog.records if r.getMessage().startswith("| memory of this device")}
    profiler = _profiler(cli.trainer)
    rows = dict(line.strip("| ").split(" | ") for line in table.splitlines()[2:])
    assert float(rows["step peak (max over steps)"]) == pytest.approx(max(p for _, p in profiler.steps), abs=1e-4)
    average = sum(a for a, _ in profiler.steps) / 2
    assert float(rows["step average (mean over steps)"]) == pytest.approx(average, abs=1e-4)
    for name, size in profiler.breakdown.as_dict().items():
        assert float(rows[name]) == pytest.approx(size / GIB, abs=1e-4)


def test_an_engine_with_its_own_memory_is_reported_beside_the_step(run_cli, monkeypatch):
    # what an engine in another process (vLLM) will provide; the in-process engine has no memory of its own
    monkeypatch.setattr(HFEngine, "memory_bytes", lambda self: 3 * GIB)
    cli = run_cli("tiny_arith", steps=1)
    assert float(cli.trainer.callback_metrics["memory/engine_gib"]) == 3.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_step_reads_the_cuda_allocator(run_cli):
    device = torch.device("cuda:0")
    sampler = StepSampler(lambda: torch.cuda.memory_allocated(device))
    sampler.start()
    spike = torch.ones(400 * MB // 4, device=device)
    time.sleep(0.1)
    del spike
    assert sampler.stop()[1] >= 400 * MB

    cli = run_cli("tiny_arith_dense_all", "--trainer.accelerator", "gpu")
    metrics = cli.trainer.callback_metrics
    for average, peak in _profiler(cli.trainer).steps:
        assert 0 < average <= peak  # the peak is the allocator's exact high-water mark
    # the device holds at least what the allocator has handed out
    assert float(metrics["memory/device_used_gib"]) >= float(metrics["memory/peak_gib"]) > 0

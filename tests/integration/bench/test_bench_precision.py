"""bench/precision.py end to end (--quick): fp32, bf16 nearest and bf16 stochastic through the CLI, one table."""

import json
import subprocess
import sys

from conftest import ROOT

TOOL = [sys.executable, "-m", "bench.precision"]  # run from the repository's root (cwd=ROOT)


def test_precision_bench_compares_the_three_variants(tmp_path):
    out, plot = tmp_path / "precision.json", tmp_path / "precision.png"
    result = subprocess.run(
        [*TOOL, "--quick", "--out", str(out), "--plot", str(plot), "--runs-dir",
         str(tmp_path / "runs")],
        check=True, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    report = json.loads(out.read_text())
    runs = {row["variant"]: row for row in report["runs"]}
    assert list(runs) == ["fp32", "bf16, nearest", "bf16, stochastic"]
    for row in runs.values():
        assert "error" not in row, row
        assert len(row["rewards"]) == len(row["landed"]) == 6 and row["step_s"] > 0
    # What the benchmark exists to show, already visible in 6 steps: fp32 lands every update, stochastic rounding
    # lands it in expectation, rounding to nearest loses most of it.
    assert abs(runs["fp32"]["landed_mean"] - 1) < 1e-3
    assert abs(runs["bf16, stochastic"]["landed_mean"] - 1) < 0.2
    assert runs["bf16, nearest"]["landed_mean"] < 0.5
    assert "| bf16, stochastic | 1 |" in result.stdout and plot.stat().st_size > 0

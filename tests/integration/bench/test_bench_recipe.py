"""bench/recipe.py --quick end to end: the shipped model's pass@k and each row's, dynamic sampling's rows generating
more completions than the rows without it, and the paired differences."""

import json
import subprocess
import sys

from conftest import ROOT

TOOL = [sys.executable, "-m", "bench.recipe"]  # run from the repository's root (cwd=ROOT)


def test_quick_mode_reports_pass_at_k_and_completions_generated(tmp_path):
    out, plot = tmp_path / "recipe.json", tmp_path / "recipe.png"
    result = subprocess.run([*TOOL, "--quick", "--out", str(out), "--plot", str(plot),
                             "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True, timeout=600,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert sorted(report["summary"]) == ["dense", "dense_ds", "logra_total", "logra_total_ds"]
    start = report["start"]
    assert 0 <= start["pass@1"] <= start["pass@2"] <= start["pass@4"] <= 1  # 4 samples: k = 1, 2, 4
    for row, entry in report["summary"].items():
        assert 0 <= entry["pass@1"][0] <= entry["pass@4"][0] <= 1, row
        plain = row.removesuffix("_ds")
        if row.endswith("_ds"):  # every round draws 32 prompts × 8 completions; at least one round per step
            assert entry["generated"][0] >= report["summary"][plain]["generated"][0] == 4 * 32 * 8
            assert entry["rounds"][0] >= 1 and "pass@1_vs_off" in entry
    assert "| shipped model |" in result.stdout and plot.stat().st_size > 0

"""bench/quality.py --quick end to end: every row of the comparison trains through the CLI on the add3 task (one seed;
the full run pairs 3), and the report holds each row's pass@1, sampled reward, realized KL and the learning-rate
grid."""

import json
import math
import subprocess
import sys

from conftest import ROOT

TOOL = [sys.executable, "-m", "bench.quality"]  # run from the repository's root (cwd=ROOT)
ROWS = ["dense_all", "dense_targets", "lora", "logra", "logra_refresh_rademacher", "logra_refresh_gaussian",
        "logra_rank2", "logra_train_rest", "pair_lora", "pair_logra_kl"]


def test_quick_mode_reports_every_row(tmp_path):
    out, plot = tmp_path / "quality.json", tmp_path / "quality.png"
    result = subprocess.run([*TOOL, "--quick", "--out", str(out), "--plot", str(plot),
                             "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True, timeout=600,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["summary"]) == ROWS
    assert 0 < report["start_pass_at_1"] < 0.5  # the task starts far from its ceiling
    for row, entry in report["summary"].items():
        assert entry["seeds"] == 1, row  # --quick: one seed (the pairing is the full run's)
        for key in ("pass_at_1", "reward_last"):
            assert 0 <= entry[key][0] <= 1, (row, key)
        assert entry["kl_per_step"][0] > 0, row  # every run measured the KL its steps realized
    # the pair: LoRA at the paper's constant 2e-4; LoGRA under a KL budget taken from LoRA's realized KL
    assert report["summary"]["pair_lora"]["lr"] == 2e-4
    assert report["summary"]["pair_logra_kl"]["kl_budget"] == report["kl_budget"] > 0
    runs = {(run["row"], run["seed"]): run for run in report["runs"]}
    assert len(runs[("pair_logra_kl", 0)]["rewards"]) == 4
    assert math.isfinite(runs[("logra", 0)]["kl_per_step"])
    grid = {entry["method"] for entry in report["grid"]}
    assert grid == {"dense_all", "dense_targets", "lora", "logra", "logra_rank2"}  # rank 2 has learning rates too
    assert "| LoGRA + train_rest, rank 16 |" in result.stdout
    assert plot.stat().st_size > 0

    # --reuse: a second call with nothing changed trains nothing and reports the same numbers
    again = subprocess.run([*TOOL, "--quick", "--reuse", "--out", str(tmp_path / "again.json"),
                            "--plot", str(plot), "--runs-dir", str(tmp_path / "runs")],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "training" not in again.stderr
    assert json.loads((tmp_path / "again.json").read_text())["summary"] == report["summary"]

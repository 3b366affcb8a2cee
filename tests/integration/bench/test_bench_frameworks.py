"""bench/frameworks.py --quick end to end on the real model: TRL's GRPOTrainer (full parameters) and this project's
LoGRA row for two steps each, TRL's saved model evaluated by this project's `validate`, and the report holds for both
rows the step's seconds and parts, tokens per second, peak memory, the held-out pass@k per task, the KL from the
base model, and LoGRA's ratios to TRL paired by seed. (The other rows are the same script's: bench/tasks.py's
configs, and TRL's with a PEFT adapter.)"""

import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("trl", reason="bench/frameworks.py compares with TRL: pip install -e .[trl]")

TASKS = ["basic_arithmetic", "letter_counting", "syllogism"]  # configs/smollm2_reasoning.yaml's


def test_quick_mode_runs_trl_and_logra_and_evaluates_both_one_way(smollm2_model, tmp_path):
    out = tmp_path / "frameworks.json"
    result = subprocess.run([sys.executable, "-m", "bench.frameworks", "--quick", "--rows", "trl_full,logra",
                             "--out", str(out), "--plot", str(tmp_path / "frameworks.png"), "--runs-dir",
                             str(tmp_path / "runs")], capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert list(summary) == ["start", "trl_full", "logra"]
    for row, entry in summary.items():
        for task in ["all", *TASKS]:
            assert 0 <= entry[f"{task}/pass@1"][0] <= entry[f"{task}/pass@8"][0] <= 1, (row, task)
        if row == "start":
            continue
        assert entry["peak_gib"][0] > 0.5 and entry["kl_from_start"][0] > 0, row  # 135M fp32 weights: 0.5 GiB
        assert entry["step_s"][0] >= entry["generation_s"][0] > 0 and entry["update_s"][0] > 0, row
        assert entry["trained_tps"][0] > entry["generated_tps"][0] > 0 and entry["completion_length"][0] >= 1, row
    ratios = summary["logra"]["vs_trl_full"]
    assert ratios["step_s_ratio"][0] > 0 and ratios["peak_gib_ratio"][0] > 0
    assert math.isfinite(ratios["all/pass@1"][0])
    assert "| TRL GRPOTrainer, full parameters (AdamW) |" in result.stdout
    # the tables as docs/results/data holds them: one row per trained row (cost), per row and the base (quality)
    measured = json.loads(out.with_suffix(".tables.json").read_text())
    assert [len(t["rows"]) for t in measured.values()] == [2, 3, 1]
    assert all(len(t["align"]) == len(t["columns"]) == len(t["rows"][0]) for t in measured.values())
    assert (tmp_path / "frameworks.png").stat().st_size > 0

"""bench/tasks.py --quick end to end on the real model: the survey of candidate tasks (two of them), then the sketch
row (LoGRA) of the comparison for one step through the CLI, and the report holds, per task, pass@1 and pass@8 before
and after, the KL from the start, peak memory and seconds per step. The other rows are the same script's runs of
the configs `run_config` builds, checked here without running (dense AdamW and APOLLO-Mini through
trainer.strategy.init_args.dense.optimizer, LoRA through its strategy:
tests/integration/learning/test_other_paths_learn.py and tests/integration/cli/test_peer_optimizers.py run those
paths)."""

import json
import math
import subprocess
import sys

from conftest import ROOT

TOOL = [sys.executable, "-m", "bench.tasks"]  # run from the repository's root (cwd=ROOT)
TASKS = ["basic_arithmetic", "letter_counting", "syllogism"]  # configs/smollm2_reasoning.yaml's


def _run(tmp_path, *args):
    out = tmp_path / "tasks.json"
    result = subprocess.run([*TOOL, "--quick", "--out", str(out), "--plot",
                             str(tmp_path / "tasks.png"), "--runs-dir", str(tmp_path / "runs"), *args],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_quick_mode_surveys_the_candidates_and_reports_each_row_per_task(smollm2_model, tmp_path):
    table = _run(tmp_path, "--survey")
    survey = json.loads((tmp_path / "tasks_survey.json").read_text())["survey"]
    assert set(survey) == {"all", "basic_arithmetic", "syllogism"}
    assert all(0 <= survey[task]["pass@1"] <= survey[task]["pass@8"] <= 1 for task in survey)
    assert "| task | settings | pass@1 | pass@8 |" in table and (tmp_path / "tasks_survey.png").stat().st_size > 0

    table = _run(tmp_path, "--rows", "logra")
    report = json.loads((tmp_path / "tasks.json").read_text())
    assert list(report["summary"]) == ["start", "logra"]
    for row, entry in report["summary"].items():
        for task in ["all", *TASKS]:
            assert 0 <= entry[f"{task}/pass@1"][0] <= entry[f"{task}/pass@8"][0] <= 1, (row, task)
        if row == "start":
            continue
        assert entry["kl_from_start"][0] >= 0 and entry["peak_gib"][0] > 0.5, row  # 135M fp32 weights: 0.5 GiB
        assert entry["step_s"][0] > 0 and math.isfinite(entry["update_s"][0]), row
        # LoGRA's KL control is part of its step; the others' KL check only logs, and is timed apart from their step
        assert math.isfinite(entry["control_s"][0]) == (row == "logra"), row
    runs = {run["row"]: run for run in report["runs"]}
    assert set(runs["logra"]["task_rewards"]) == set(TASKS) and len(runs["logra"]["rewards"]) == 1
    assert "| LoGRA (sketch Adam, rank 16, total KL budget) |" in table
    assert (tmp_path / "tasks.png").stat().st_size > 0


def test_each_row_is_the_shipped_config_with_its_method():
    from bench import tasks

    args = tasks.parse_args(["--quick"])
    configs = {run["row"]: tasks.run_config(run, args) for run in tasks.comparison_runs(args)[1:]}
    assert list(configs) == ["logra", "dense", "lora", "apollo_mini"]
    strategies = {row: config["trainer"].get("strategy", {}).get("class_path", "") for row, config in configs.items()}
    assert strategies["logra"].endswith("SketchStrategy") and strategies["lora"].endswith("LoRAStrategy")
    assert strategies["dense"] == strategies["apollo_mini"] == "lightning_logra.train.strategies.DenseStrategy"
    dense = {row: configs[row]["trainer"]["strategy"]["init_args"]["dense"] for row in ("dense", "apollo_mini")}
    assert dense["dense"]["lr"] == args.dense_lr and "optimizer" not in dense["dense"]
    assert dense["apollo_mini"]["optimizer"]["class_path"] == "apollo_torch.APOLLOAdamW"
    assert dense["dense"]["target_modules"] == dense["apollo_mini"]["target_modules"] == tasks.TARGETS
    assert configs["lora"]["trainer"]["strategy"]["init_args"]["lora"]["lr"] == args.lora_lr
    for row, config in configs.items():  # the same steps, tasks and measurements; LoGRA alone is KL-controlled
        assert config["trainer"]["max_steps"] == 1 and config["model"]["sampling"]["num_generations"] == 4, row
        assert config["model"]["rollouts"]["engine"] is None and config["model"]["scoring"]["timeout_s"] is None, row
        budget = next(c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("PredictedKLBudget"))
        assert (budget["init_args"].get("budget") == 1e6) == (row != "logra"), row

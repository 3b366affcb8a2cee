"""bench/gpu_check.py (`python -m bench.gpu_check`, its stages in bench/gpu_stages/): its CPU dry run goes through every
stage and reports each; a stage that raises is recorded with its error while the next still runs, and the report on
disk is whole after every write."""

import json
import os
import subprocess
import sys
from unittest.mock import ANY

import pytest

from conftest import ROOT


@pytest.fixture
def gpu_check():
    from bench import gpu_check

    return gpu_check


def test_a_stage_that_raises_is_recorded_and_the_next_still_runs(gpu_check, tmp_path):
    out = tmp_path / "report.json"
    report, plan = {"stages": {}}, gpu_check.Plan.dry()
    on_disk_mid_stage = []

    def fails_after_a_partial_result(plan, progress):
        progress({"rows": [1]})
        on_disk_mid_stage.append(json.loads(out.read_text()))
        raise ValueError("out of memory, say")

    gpu_check.run_stage("first", fails_after_a_partial_result, plan, report, out)
    gpu_check.run_stage("second", lambda plan, progress: {"value": 2}, plan, report, out)
    plan.fail_stage = "third"
    gpu_check.run_stage("third", lambda plan, progress: {"value": 3}, plan, report, out)

    # what a run cut short during the first stage would have left
    assert on_disk_mid_stage == [{"stages": {"first": {"status": "running", "result": {"rows": [1]}, "seconds": ANY}}}]
    stages = json.loads(out.read_text())["stages"]
    assert list(stages) == ["first", "second", "third"]
    assert stages["first"]["status"] == "error"
    assert stages["first"]["error"] == "ValueError: out of memory, say"
    assert "raise ValueError" in stages["first"]["traceback"]
    assert stages["first"]["result"] == {"rows": [1]}  # the partial result stays beside the error
    assert stages["second"] == {"status": "ok", "result": {"value": 2}, "seconds": ANY}
    assert stages["third"]["status"] == "error" and "injected" in stages["third"]["error"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["report.json"]  # no temporary file left behind
    table = gpu_check.markdown({"stages": stages})
    assert "| first | error |" in table and "| second | ok |" in table


def test_a_stage_that_cannot_run_here_is_recorded_as_skipped_with_its_reason(gpu_check, tmp_path):
    report = {"stages": {}}

    def needs_two_gpus(plan, progress):
        raise gpu_check.StageSkipped("needs 2 GPUs; 1 visible")

    gpu_check.run_stage("vllm_colocated", needs_two_gpus, gpu_check.Plan.dry(), report, tmp_path / "report.json")
    assert report["stages"]["vllm_colocated"] == {"status": "skipped", "reason": "needs 2 GPUs; 1 visible",
                                                  "seconds": ANY}
    assert "| vllm_colocated | skipped | 0 | needs 2 GPUs; 1 visible |" in gpu_check.markdown(report)


def test_once_the_checks_time_is_spent_no_stage_or_row_starts(gpu_check, tmp_path):
    # The check must fit one device call: what has not started by then says so instead of running.
    import time

    from bench.gpu_stages.memory_table import memory_table

    plan, report = gpu_check.Plan.dry(), {"stages": {}}
    plan.ends_at = time.monotonic() - 1
    gpu_check.run_stage("memory_table", gpu_check.stage_function("memory_table"), plan, report,
                        tmp_path / "report.json")
    assert report["stages"]["memory_table"]["status"] == "skipped"
    assert report["stages"]["memory_table"]["reason"] == "not started: the check's 3600 s were spent"
    rows = memory_table(plan, lambda result: None)["rows"]  # a stage under way: its later rows
    assert [(row["method"], row["error"]) for row in rows] == [
        (method, "not run: the check's 3600 s were spent") for method in plan.memory_methods["tiny"]]


# 3.5 minutes alone, in the bench tier with the other scripts' quick modes (not in CI, for its 45-minute budget): run
# `make test-bench ARGS="-k dry_run"` when bench/gpu_check.py, its stages or what they drive change, and before
# spending a lent device's minutes on the check
@pytest.mark.bench
def test_the_dry_run_reports_every_stage(tmp_path):
    out = tmp_path / "gpu_check.json"
    # This checkout's package, whichever one the interpreter has installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    stages = report["stages"]
    assert list(stages) == ["environment", "memory_table", "full_load", "profile", "cuda_tests", "kl_control",
                            "peer_table", "tiny_arith", "vllm_colocated"]
    for name, entry in stages.items():
        assert entry["status"] == "ok", (name, entry.get("error"), entry.get("traceback"))
        assert f"| {name} | ok |" in run.stdout

    assert stages["environment"]["result"]["torch"]
    tests = stages["cuda_tests"]["result"]
    assert tests["exit_code"] == 0 and tests["error"] == tests["failed"] == 0
    names = [case["test"] for case in tests["tests"]]
    assert "tests.integration.cli.test_memory_profiler::test_a_gpu_step_reads_the_cuda_allocator" in names
    assert tests["passed"] + tests["skipped"] == len(names)

    rows = stages["memory_table"]["result"]["rows"] + stages["peer_table"]["result"]["rows"]
    assert [(row["shape"], row["method"], row["weights"]) for row in rows] == [
        ("tiny", "logra_adam", "bf16"), ("tiny", "dense_adamw_bf16", "bf16"), ("tiny", "lora", "bf16"),
        ("tiny", "adafactor", "fp32 master + bf16 autocast")]
    for row in rows:
        assert 0 < row["avg_gib"] <= row["peak_gib"] and row["step_s"] > 0, row
    assert "| tiny | adafactor | fp32 master + bf16 autocast |" in run.stdout  # the peers in the same table

    # Where the step's time went: the sketch's own ranges, each called once per sketched matrix (or group) and
    # micro-batch, inside the profiled step; the ops ranked by their own time.
    (profiled,) = stages["profile"]["result"]["rows"]
    found = profiled["profile"]
    ranges = {entry["range"]: entry for entry in found["sketch"]}
    assert set(ranges) == {"sketch: project x·Aᵀ", "sketch: contract δᵀz"}
    assert 0 < sum(entry["s"] for entry in ranges.values()) < found["step_s"]
    assert ranges["sketch: contract δᵀz"]["calls"] > 0 and len(found["top_ops"]) == 12
    assert [op["self_s"] for op in found["top_ops"]] == sorted((op["self_s"] for op in found["top_ops"]), reverse=True)
    assert "| logra_adam |" in run.stdout.split("profiled step s")[1]

    kl = stages["kl_control"]["result"]
    assert len(kl["steps"]) == 2 and kl["budget"]["budget"] == 2e-4 and kl["subset"] == 2  # qwen1_5b.yaml's
    for step in kl["steps"]:
        assert step["grad_norm"] > 0 and 0 < step["alpha"] <= kl["budget"]["alpha_max"]
        assert step["acting"] == (step["alpha"] < kl["budget"]["alpha_max"])
    assert kl["acting_rate"] == sum(step["acting"] for step in kl["steps"]) / 2
    share = kl["kl_share"]  # qwen1_5b.yaml's batch: 32 prompts × 8 generations
    assert share["config_batch"] == 256 and share["kl_s_per_response"] > 0 and share["train_s_per_response"] > 0
    assert share["share"] == pytest.approx(2 * share["kl_s_per_response"] / (
        2 * share["kl_s_per_response"] + 256 * share["train_s_per_response"]))

    arith = stages["tiny_arith"]["result"]
    assert arith["steps"] == 2 and len(arith["rewards"]) == 2
    assert all(0 <= reward <= 1 for reward in arith["rewards"])
    assert arith["reward_first"] == arith["rewards"][0] and arith["reward_last"] == arith["rewards"][-1]
    assert arith["kl_acting_rate"] is not None and arith["peak_gib"] > 0

    # The full load by handles (shared memory on the CPU, CUDA IPC on a GPU) and by bytes: the receiver's copies
    # equal the sender's after every load, and the handles are a few hundred bytes per tensor.
    load = stages["full_load"]["result"]
    rows = {row["path"]: row for row in load["rows"]}
    assert list(rows) == ["bytes", "shared"] and load["shape"] == "tiny"
    assert rows["bytes"]["bytes_sent"] >= load["tensor_bytes"] > 0
    assert rows["shared"]["bytes_sent"] < 512 * load["tensors"]
    for row in rows.values():
        assert row["max_abs_diff"] == 0.0 and len(row["seconds_all"]) == 2 and row["seconds"] > 0
    assert 0 < rows["bytes"]["packing_s"] < rows["bytes"]["seconds"]

    # FSDP on 2 CPU processes with one 2-way tensor-parallel vLLM engine in the trainer's ranks (no sleep mode on
    # the CPU): every sync's exact comparison found the engine equal to the trainer, nothing loaded.
    colocated = stages["vllm_colocated"]["result"]
    assert colocated["steps"] == 2 and colocated["sleep"] is False
    assert colocated["max_abs_diff"] == 0.0 and colocated["loads"] == 0 and colocated["logprob_abs_diff"] < 1e-5
    assert colocated["step_s"] > colocated["rollout_s"] > 0 and colocated["sync_bytes"] > 0

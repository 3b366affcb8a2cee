"""bench/memory.py end to end on the tiny shape: one worker subprocess per method, a JSON report and a plot. In bf16
the dense baseline keeps fp32 master weights (bf16-mixed) and LoGRA trains the bf16 weights; in fp32 LoGRA's step
holds less memory than dense AdamW's."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import ROOT

TOOL = [sys.executable, "-m", "bench.memory"]  # run from the repository's root (cwd=ROOT)

# Parameters of the tiny shape: the tied 1000×128 embedding, and per layer q (128×128 + bias), k and v (128×64 + bias
# each), o (128×128), gate/up/down (3 × 128×384) and two norms; then the final norm. = 522,368.
TINY_PARAMS = 1000 * 128 + 2 * (2 * 128 * 128 + 128 + 2 * (128 * 64 + 64) + 3 * 128 * 384 + 2 * 128) + 128


def _bench(tmp_path: Path, dtype: str, methods: list[str]) -> dict:
    out, plot = tmp_path / f"{dtype}.json", tmp_path / f"{dtype}.png"
    subprocess.run(
        [*TOOL, "--shape", "tiny", "--dtype", dtype, "--steps", "2",
         "--methods", ",".join(methods), "--out", str(out), "--plot", str(plot)],
        check=True, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert plot.stat().st_size > 0
    return json.loads(out.read_text())


def test_memory_bench_writes_rows_and_plot(tmp_path):
    report = _bench(tmp_path, "bf16", ["dense_adamw", "logra_lightning"])
    assert set(report) == {"rows", "settings"}
    assert report["settings"]["shape"] == "tiny"
    rows = {row["method"]: row for row in report["rows"]}
    assert list(rows) == ["dense_adamw", "logra_lightning"]  # the last: a Trainer + MemoryProfiler
    for row in rows.values():
        assert set(row) - {"saved_bytes", "state_mib"} == {"method", "weights", "peak_gib", "avg_gib", "step_s"}, row
        assert row["peak_gib"] > 0 and row["avg_gib"] > 0 and row["step_s"] > 0
        assert row["avg_gib"] <= row["peak_gib"]
    assert rows["dense_adamw"]["weights"] == "fp32 master + bf16 autocast"
    assert rows["logra_lightning"]["weights"] == "bf16"


def test_logra_holds_less_memory_than_dense_adamw(tmp_path):
    # In fp32, so that both methods run the same kernels on the same weights: at the tiny shape the process itself
    # (Python, torch) is ~480 MiB of the ~490 MiB measured, and in bf16 the CPU's bf16 kernels add a few MiB of
    # their own that differ between an autocast and a bf16 model. The process part is the same in every worker
    # (repeated runs agree within 0.5 MiB), so the difference is the methods' own memory: dense AdamW's fp32
    # gradient and two fp32 moments, 12 bytes per parameter ≈ 6.0 MiB, against LoGRA's d×16 sketches (0.16 MiB).
    # Measured: 10 MiB more at the peak, 7.5 on average. Half the prediction leaves room for noise and still fails
    # if LoGRA's memory is not clearly below dense AdamW's.
    rows = {row["method"]: row for row in _bench(tmp_path, "fp32", ["logra", "logra_shared", "dense_adamw"])["rows"]}
    assert rows["logra"]["weights"] == rows["dense_adamw"]["weights"] == "fp32"
    dense_extra_gib = 12 * TINY_PARAMS / 2**30
    for key in ("peak_gib", "avg_gib"):
        assert rows["dense_adamw"][key] - rows["logra"][key] > dense_extra_gib / 2, (key, rows)
    # One projection per input: per layer, k_proj, v_proj and up_proj no longer save their own x·Aᵀ, an (n, r) fp32
    # tensor with n = micro-batch 4 × (64 + 64) tokens and r = 16 (the tiny shape's rank), 2 layers. Exact bytes.
    assert rows["logra"]["saved_bytes"] - rows["logra_shared"]["saved_bytes"] == 2 * 3 * (4 * 128) * 16 * 4
    assert rows["dense_adamw"]["saved_bytes"] > rows["logra"]["saved_bytes"]  # x (n, k) per matrix, not x·Aᵀ


def test_kl_check_and_the_meta_floor_of_dense_adamw(tmp_path):
    # The headline's options at the tiny shape: one measured step with the KL check inside LoGRA's step (its seconds
    # a share of the step's), and dense AdamW's floor from the meta device, 16 bytes per parameter exactly.
    out = tmp_path / "kl.json"
    subprocess.run(
        [*TOOL, "--shape", "tiny", "--dtype", "bf16", "--steps", "1", "--kl-check", "2",
         "--methods", "logra_adam,dense_adamw_meta", "--out", str(out), "--no-plot"],
        check=True, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    rows = {row["method"]: row for row in json.loads(out.read_text())["rows"]}
    logra, floor = rows["logra_adam"], rows["dense_adamw_meta"]
    assert 0 < logra["kl_s"] < logra["step_s"] and logra["kl_share"] == pytest.approx(logra["kl_s"] / logra["step_s"])
    assert floor["peak_gib"] == floor["avg_gib"] == 16 * TINY_PARAMS / 2**30
    assert not {"step_s", "kl_s", "saved_bytes"} & set(floor)  # nothing ran


def test_sharded_ranks_hold_less_than_ddp_ranks(tmp_path):
    # logra_ddp and logra_fsdp: 2 processes each, every rank on the same batch. Their "state" is memory_breakdown's
    # count (weights, sketches, sketch Adam's state), not a measurement: a DDP rank holds the 522,368 parameters
    # (2.0 MiB) and the state of all rows; an FSDP rank half of every sharded matrix and of the state, plus the tied
    # 1000×128 embedding, which stays whole (it is the LM head): 1.52 against 2.40 MiB.
    report = _bench(tmp_path, "fp32", ["logra_ddp", "logra_fsdp"])
    if any("error" in row for row in report["rows"]):
        # A 2-process launch failed once in a full CI run and never alone (cause not found yet): one more try, and
        # the first failure said, so that it is seen rather than hidden.
        warnings.warn(f"bench.memory's 2-process rows failed, retried once: {report['rows']}", stacklevel=1)
        report = _bench(tmp_path, "fp32", ["logra_ddp", "logra_fsdp"])
    rows = {row["method"]: row for row in report["rows"]}
    assert not any("error" in row for row in rows.values()), rows
    assert report["settings"]["processes"] == 2
    assert rows["logra_ddp"]["processes"] == rows["logra_fsdp"]["processes"] == 2
    assert rows["logra_fsdp"]["state_gib"] < 0.7 * rows["logra_ddp"]["state_gib"]
    assert all(row["peak_gib"] > 0 and row["avg_gib"] <= row["peak_gib"] for row in rows.values())


@pytest.fixture
def memory():
    from bench import memory

    return memory


def test_rounds_rotate_the_order_and_report_each_rows_spread(memory, monkeypatch):
    calls = []

    def run_method(method, argv, timeout_s=None):  # a row run later measures slower, as on these 2 cores
        calls.append(method)
        position = len(calls) % 3
        return dict(method=method, peak_gib=1.0 + position, avg_gib=1.0, step_s=1.0 + 0.1 * position)

    monkeypatch.setattr(memory, "run_method", run_method)
    rows = memory.run_rounds(["a", "b", "c"], [], rounds=3)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # each row first, middle and last once
    for row in rows:
        assert sorted(row["step_s_rounds"]) == pytest.approx([1.0, 1.1, 1.2]) and row["rounds"] == 3
        assert row["step_s"] == pytest.approx(1.1) and row["peak_gib"] == 3.0
    assert "(1.00–1.20)" in memory.markdown_table(rows)


def test_peer_rows_count_the_state_their_optimizers_hold_in_fp32_under_bf16_mixed_too(tmp_path):
    # Tiny shape, rank 16, the 14 target matrices (393,216 weights): 8-bit AdamW two bytes per weight (plus its
    # block scales), GaLore layer-wise its rank-16 moments and projections, APOLLO-Mini rank-1 ones, SGD on sketches
    # none. Counted from the optimizers' tensors, not measured: exact orderings, not noise.
    rows = {row["method"]: row for row in _bench(tmp_path, "fp32", ["galore_layerwise", "adamw_8bit", "apollo_mini",
                                                                      "logra", "galore"])["rows"]}
    assert not any("error" in row for row in rows.values()), rows
    state = {method: row["state_mib"] for method, row in rows.items()}
    assert state["logra"] == 0 < state["apollo_mini"] < state["galore_layerwise"] < state["adamw_8bit"]
    assert 2 * 393_216 / 2**20 < state["adamw_8bit"] < 2.1 * 393_216 / 2**20
    assert rows["galore_layerwise"]["weights"] == "fp32"
    # bf16-mixed autocasts the forward alone: GaLore steps the fp32 weights outside it, so its projection and moments
    # are fp32 as in an fp32 run (a step inside the autocast kept its moments in bf16: 134 MiB against 241 at 0.5B).
    assert _bench(tmp_path, "bf16", ["galore"])["rows"][0]["state_mib"] == state["galore"] > 0


def test_at_shapes_adds_up_each_methods_state_without_a_model(memory, tmp_path):
    out = tmp_path / "at.json"
    memory.main(["--at-shapes", "tiny", "--rank", "16", "--out", str(out)])
    rows = {row["method"]: row for row in json.loads(out.read_text())["rows"]}
    shapes = memory.target_shapes("tiny")  # per layer q, o 128×128; k, v 64×128; gate, up 384×128; down 128×384
    assert shapes == {(128, 128): 4, (64, 128): 4, (384, 128): 4, (128, 384): 2}
    trained = sum(d * k * n for (d, k), n in shapes.items())
    gb = {method: {key: row[key] * 1e9 for key in row if key.endswith("_gb")} for method, row in rows.items()}
    # torch's AdamW on bf16 weights: two bf16 moments and a 4-byte step count per matrix
    assert gb["dense_adamw_targets"]["state_gb"] == pytest.approx(4 * trained + 4 * 14)
    assert gb["dense_adamw_targets"]["gradients_gb"] == pytest.approx(2 * trained)
    assert gb["galore_layerwise"]["gradients_gb"] == pytest.approx(2 * 384 * 128)  # one matrix at a time
    assert gb["galore_layerwise"]["state_gb"] == gb["galore"]["state_gb"] < gb["dense_adamw_targets"]["state_gb"]
    sketches = sum(4 * d * 16 * n for (d, _), n in shapes.items())
    assert gb["logra"]["gradients_gb"] == pytest.approx(sketches) and gb["logra"]["state_gb"] == 0
    assert gb["logra_adam"]["state_gb"] == pytest.approx(2 * sketches)
    assert gb["lora_r1"]["state_gb"] == pytest.approx(8 * sum((d + k) * n for (d, k), n in shapes.items()))
    assert rows["logra"]["with_masters_gb"] == rows["logra"]["total_gb"]  # its merge rounds stochastically

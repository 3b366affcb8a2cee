"""bench/rank_sweep.py end to end at a small scale: cosines beside √(r/(r+k)), reward runs through the CLI (one
fixed-projection rank of the cosines' three: rank 256 does not fit the embedded model, and rank 48 would be one more
run of the same kind)."""

import json
import subprocess
import sys

from conftest import ROOT

TOOL = [sys.executable, "-m", "bench.rank_sweep"]  # run from the repository's root (cwd=ROOT)


def test_rank_sweep_reports_cosines_and_reward_runs(tmp_path):
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    subprocess.run(
        [*TOOL, "--cos-shape", "tiny", "--cos-layers", "1", "--ranks", "4", "48", "256",
         "--reward-ranks", "4", "256", "--reward-in-trainer",
         "--seeds", "2", "--steps", "3", "--parallel", "2", "--refresh-every", "1", "--share-projection",
         "--out", str(out), "--plot", str(plot), "--runs-dir", str(tmp_path / "runs")],
        check=True, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    report = json.loads(out.read_text())
    cosines = {(row["rank"], row["distribution"]): row for row in report["cosines"] if not row["shared"]}
    assert set(cosines) == {(r, d) for r in (4, 48, 256) for d in ("rademacher", "gaussian")}
    # one A per input (q/k/v, gate/up): each matrix's cosine still follows √(r/(r+k))
    shared = {row["rank"]: row for row in report["cosines"] if row["shared"]}
    assert set(shared) == {4, 48, 256} and shared[48]["matrices"] == 7
    for row in (shared[4], shared[48]):
        assert 0.7 < row["cosine"] / row["theory"] < 1.3, row
    # A sketch needs rank < in_features: rank 48 fits all 7 matrices of a tiny-shape layer (in_features 128, and
    # 384 for down_proj), rank 256 only down_proj.
    assert cosines[(48, "rademacher")]["matrices"] == 7 and cosines[(256, "rademacher")]["matrices"] == 1
    for distribution in ("rademacher", "gaussian"):
        low, high = cosines[(4, distribution)], cosines[(48, distribution)]
        assert 0 < low["cosine"] < high["cosine"] < 1
        for row in (low, high):
            assert 0.7 < row["cosine"] / row["theory"] < 1.3, row  # √(r/(r+k)), up to sampling noise
    runs = [row["name"] for row in report["rewards"]]
    assert runs == ["rank 4, fixed rademacher", "rank 16, refreshed rademacher", "rank 16, refreshed gaussian",
                    "rank 16, fixed rademacher, one A per input"]  # rank 256 left out: it does not fit
    for row in report["rewards"]:
        assert "error" not in row, row
        assert 0 <= row["reward_first"] <= 1 and 0 <= row["pass_at_1"] <= 1
    assert plot.stat().st_size > 0

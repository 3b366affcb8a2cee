"""bench/frontier.py --quick end to end: every kind of row of the reward–KL frontier trains through the CLI on add3
(of the rows that differ only by a number, one learning rate of dense and of uncontrolled LoGRA, and two constant δ),
each run measures its distance from the starting policy at every evaluation, and the rows set from measured values
(the total budgets, the best of the constant-δ rows) take them from this invocation's runs."""

import json
import statistics
import subprocess
import sys

import pytest

from conftest import ROOT

TOOL = [sys.executable, "-m", "bench.frontier"]  # run from the repository's root (cwd=ROOT)
ROWS = ["pair_lora", "dense", "lora", "lora_rank1", "logra_delta0.1", "logra_delta1", "logra_lr0.001",
        "peer_galore_lr0.0001", "logra_total", "pair_logra_total", "dense_beta"]


def test_quick_mode_places_every_row_on_the_frontier(tmp_path):
    out, plot, runs_dir = tmp_path / "frontier.json", tmp_path / "frontier.png", tmp_path / "runs"
    args = [*TOOL, "--quick", "--plot", str(plot), "--runs-dir", str(runs_dir)]
    result = subprocess.run([*args, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["summary"]) == ROWS
    runs = {row: results[0] for row, results in report["runs"].items()}
    for row, run in runs.items():
        # the start, then a measurement every 2 of the 4 steps: all of them taken, the first at π_0 itself
        assert len(run["kl_curve"]) == len(run["pass_curve"]) == 3, row
        assert run["kl_curve"][0] == 0.0 and run["pass_curve"][0] == report["start_pass_at_1"], row
        assert run["kl_curve"][-1] > 0, row  # every row moved, and its distance was measured
        assert 0 <= run["pass_at_1"] <= 1, row
    # the rows set from this invocation's measurements
    assert runs["pair_logra_total"]["total"] == pytest.approx(statistics.fmean(
        r["kl_sum"] for r in report["runs"]["pair_lora"]))
    best = max((row for row in ROWS if row.startswith("logra_delta")),
               key=lambda row: report["summary"][row]["pass_at_1"][0])
    assert runs["logra_total"]["total"] == pytest.approx(report["summary"][best]["kl_sum"][0])
    assert runs["dense_beta"]["beta"] == 0.04
    config = (runs_dir / "configs" / "peer_galore_lr0.0001_seed0.yaml").read_text()
    # a peer through trainer.strategy.init_args.dense.optimizer, on the frontier too
    assert "class_path: galore_torch.GaLoreAdamW" in config and "DenseStrategy" in config
    # how much of the gradient a sketch sees: about √(r/(r+k)) (docs/results/rank-and-projection.md), so more at rank
    # 64 than at 16
    cosines = report["sketch_cosines"]
    assert 0.25 < cosines["16"] < 0.4 and cosines["16"] < cosines["64"] < 0.7
    assert "| LoGRA r16, total budget |" in result.stdout and plot.stat().st_size > 0

    # --reuse: nothing changed, nothing trained, the same report (the cosines read back from beside the runs)
    again = subprocess.run([*args, "--reuse", "--out", str(tmp_path / "again.json")], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "training" not in again.stderr
    second = json.loads((tmp_path / "again.json").read_text())
    assert second["summary"] == report["summary"] and second["sketch_cosines"] == cosines


def test_dense_frontier_is_the_best_reached_within_a_distance():
    from bench.frontier import frontier_at

    # one run whose KL overshoots early (0.3 at pass 0.4) before settling, and one that creeps out steadily
    overshoot = ([0.0, 0.3, 0.2, 0.25], [0.2, 0.4, 0.5, 0.7])
    steady = ([0.0, 0.1, 0.2], [0.2, 0.3, 0.6])
    assert frontier_at([steady], 0.15) == (pytest.approx(0.45), False)  # along the segment
    # at 0.25 the overshooting run's first crossing (0 → 0.3) reads 0.367, its last point 0.7: the best counts
    assert frontier_at([overshoot, steady], 0.25) == (pytest.approx(0.7), False)
    assert frontier_at([overshoot, steady], 0.2) == (pytest.approx(0.6), False)  # steady's point at 0.2 beats 0.5
    assert frontier_at([overshoot, steady], 0.5) == (0.7, True)  # beyond every curve: the best point, marked


def test_a_subset_of_rows_runs_against_dense_and_the_peers_frontier():
    from bench import frontier

    # --rows picks rows by pattern; dense's rows always run (every row is placed against them), and the total
    # budget's Σ comes from --total-budget when the constant-δ rows it is otherwise set from do not run
    args = frontier.parse_args(["--rows", "logra_total,peer_galore*", "--total-budget", "2.2", "--peers",
                                "galore,adafactor"])
    assert {run["row"] for run in frontier.first_rows(args)} == {"dense", "dense_lr0.0003", "peer_galore_lr0.0001"}
    second = frontier.second_rows(args, {"dense": []})
    assert sorted({run["row"] for run in second}) == ["dense_beta", "logra_total"]
    assert {run["total"] for run in second if run["row"] == "logra_total"} == {2.2}
    with pytest.raises(SystemExit, match="logra_total without the logra_delta\\* rows needs --total-budget"):
        frontier.parse_args(["--rows", "logra_total"])

    def run(row, pass_at_1, kl):  # one seed's measurements: the start, then the row's end
        return {"row": row, "seed": 0, "kl_curve": [0.0, kl], "pass_curve": [0.2, pass_at_1], "pass_at_1": pass_at_1,
                "kl_from_start": kl, "reward_last": 0.5, "kl_sum": 1.0}

    measured = {"dense": [run("dense", 0.6, 0.4)], "peer_a": [run("peer_a", 0.5, 0.2)],
                "peer_b": [run("peer_b", 0.7, 0.5)], "logra_total": [run("logra_total", 0.55, 0.3)]}
    summary = frontier.summarize(measured)
    # at KL 0.3: peer_a's end (0.5) and peer_b's curve interpolated (0.2 + 0.5·0.3/0.5 = 0.5); dense's 0.5 too
    assert summary["logra_total"]["vs_peers_at_kl"][0] == pytest.approx(0.05)
    assert summary["logra_total"]["vs_dense_at_kl"][0] == pytest.approx(0.55 - (0.2 + 0.4 * 0.3 / 0.4))
    assert summary["peer_a"]["vs_peers_at_kl"][0] == pytest.approx(0.5 - (0.2 + 0.5 * 0.2 / 0.5))  # b's alone
    assert "vs_peers_at_kl" not in frontier.summarize({"dense": measured["dense"]})["dense"]

"""Evaluation beyond greedy pass@1: the unbiased pass@k against counting every k-subset, maj@k's vote, and the test
report written beside the checkpoint."""

import itertools
import json
import math

import pytest
import torch

from lightning_logra.train.evaluation import ks, majority, pass_at_k, report_path, sample_metrics, write_report


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_right_completion(n):
    for c in range(n + 1):
        right = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(right, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)
    assert pass_at_k(200, 1, 1) == pytest.approx(1 / 200) and math.isfinite(pass_at_k(10_000, 3, 5_000))


def test_the_ks_reported():
    assert ks(1) == [1] and ks(8) == [1, 2, 4, 8] and ks(6) == [1, 2, 4, 6] and ks(16) == [1, 2, 4, 8, 16]


def test_majority_votes_on_final_answers_and_scores_the_winner():
    # "Answer:" lines and \boxed{} are compared as answers; other completions by their stripped text
    assert majority(["x Answer: 4", "Answer: 5", "so \\boxed{4}"], [1.0, 0.0, 1.0]) == 1.0
    assert majority([" 12 ", "12", "21"], [0.0, 0.0, 1.0]) == 0.0
    assert majority(["a", "b"], [0.0, 1.0]) == 0.0  # a tie: the answer met first


def test_sample_metrics_per_prompt():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    texts = ["1", "2", "2", "3", "9", "9", "9", "9"]
    metrics = sample_metrics(rewards, texts, "val")
    assert sorted(metrics) == ["val/maj@4", "val/mean@4", "val/pass@1", "val/pass@2", "val/pass@4"]
    assert metrics["val/pass@1"].tolist() == [0.25, 0.0] and metrics["val/pass@4"].tolist() == [1.0, 0.0]
    assert metrics["val/pass@2"][0] == pytest.approx(0.5) and metrics["val/maj@4"].tolist() == [0.0, 0.0]
    assert metrics["val/mean@4"].tolist() == [0.25, 0.0]


def test_the_report_lies_beside_the_checkpoint_and_is_written_whole(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"x")
    assert report_path(str(ckpt), "logs") == tmp_path / "last.test.json"
    (tmp_path / "sharded.ckpt").mkdir()
    assert report_path(str(tmp_path / "sharded.ckpt"), None) == tmp_path / "sharded.ckpt.test.json"
    assert report_path(None, str(tmp_path / "run")) == tmp_path / "run" / "test.json"
    table = write_report({"test/pass@16": 0.5, "test/pass@2": 0.25}, tmp_path / "last.test.json", {"model": "m"})
    assert table.splitlines()[2:] == ["| test/pass@2 | 0.2500 |", "| test/pass@16 | 0.5000 |"]
    assert json.loads((tmp_path / "last.test.json").read_text()) == {
        "model": "m", "metrics": {"test/pass@16": 0.5, "test/pass@2": 0.25}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.test.json", "sharded.ckpt"]

"""The DAPO recipe and evaluation through the command line: dynamic sampling (and a resume that equals the
uninterrupted run), over-long completions masked and penalized with the entropy bonus on, rewards that are a model and
an LLM judge in their own processes, and `test` with pass@k written beside the checkpoint."""

import glob
import json
import math

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from reward_stubs import start_judge, train_reward_classifier

DYNAMIC = ["--model.rollouts.dynamic_sampling", "true", "--model.rollouts.max_generation_rounds", "3",
           "--model.sampling.num_generations", "2"]


def _scalars(root, tag):
    events = EventAccumulator(glob.glob(str(root / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def test_dynamic_sampling_draws_more_rounds_and_a_resumed_run_equals_the_uninterrupted_one(run_cli, tmp_path):
    straight = run_cli("tiny_arith", *DYNAMIC, steps=4, root=tmp_path / "a")
    rounds = _scalars(tmp_path / "a", "rollout/generation_rounds")
    drawn = _scalars(tmp_path / "a", "rollout/prompts_drawn")
    assert len(rounds) == 4 and max(rounds) > 1 and drawn == [4 * r for r in rounds]
    filtered, missing = (_scalars(tmp_path / "a", f"rollout/{key}") for key in ("filtered_groups", "missing_groups"))
    # every group drawn was kept, filtered out, or beyond the 4 the step needed
    assert all(f + 4 - m <= d for f, m, d in zip(filtered, missing, drawn))
    run_cli("tiny_arith", *DYNAMIC, steps=2, root=tmp_path / "b")
    checkpoint = glob.glob(str(tmp_path / "b" / "**" / "checkpoints" / "last.ckpt"), recursive=True)
    resumed = run_cli("tiny_arith", *DYNAMIC, "--ckpt_path", checkpoint[0], steps=4, root=tmp_path / "c")
    a, b = straight.model.policy.state_dict(), resumed.model.policy.state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert _scalars(tmp_path / "c", "rollout/generation_rounds") == rounds[2:]


@pytest.mark.parametrize("config", ["tiny_arith", "tiny_arith_bf16"])  # bf16: the weights and the bonus's gradient
def test_truncated_completions_masked_and_penalized_with_the_entropy_bonus(run_cli, tmp_path, config):
    reward = {"model": {"reward": ["conftest.odd_first_digit", {
        "class_path": "lightning_logra.rewards.OverlongPenalty", "init_args": {"max_length": 3, "buffer": 2}}],
        "scoring": {"weights": [1.0, 0.5]}}}
    (tmp_path / "reward.yaml").write_text(yaml.safe_dump(reward))
    run_cli(config, "--config", str(tmp_path / "reward.yaml"), "--model.sampling.max_new_tokens", "3",
            "--model.loss.mask_truncated_completions", "true", "--model.loss.entropy_coef", "0.01", root=tmp_path)
    penalty = _scalars(tmp_path, "reward/OverlongPenalty/mean")
    clipped = _scalars(tmp_path, "completions/clipped_ratio")
    # a random model rarely stops within 3 tokens: most completions are cut, and those score −1
    assert len(penalty) == 2 and all(-1 <= p < 0 for p in penalty) and max(clipped) > 0.5
    assert all(math.isfinite(v) for v in _scalars(tmp_path, "train/entropy") + _scalars(tmp_path, "train/loss"))


def test_a_classifier_and_an_llm_judge_score_in_processes_of_their_own(run_cli, tmp_path):
    classifier = train_reward_classifier(tmp_path / "rm")
    server = start_judge()
    try:
        reward = {"model": {"reward": [
            {"class_path": "lightning_logra.rewards.RewardModel", "init_args": {"path": str(classifier)}},
            {"class_path": "lightning_logra.rewards.LLMJudge", "init_args": {"url": server.url, "model": "stub"}}],
            "scoring": {"weights": [0.5, 1.0]}}}
        (tmp_path / "reward.yaml").write_text(yaml.safe_dump(reward))
        cli = run_cli("tiny_arith", "--config", str(tmp_path / "reward.yaml"), "--trainer.limit_val_batches", "0",
                      root=tmp_path / "run")
    finally:
        server.shutdown()
    assert cli.model.rewards[0].fn.name.startswith("RewardModel(")  # each in a process of its own (TimedReward)
    assert len(server.requests) == 2 * 4 * 8  # every completion of both steps was judged
    for key in ("RewardModel", "LLMJudge"):
        values = _scalars(tmp_path / "run", f"reward/{key}/mean")
        assert len(values) == 2 and all(math.isfinite(v) for v in values), key
    assert all(0 <= v <= 1 for v in _scalars(tmp_path / "run", "reward/LLMJudge/mean"))


def test_the_test_command_reports_pass_at_k_beside_the_checkpoint(run_cli, tmp_path):
    run_cli("tiny_arith", root=tmp_path / "fit")
    checkpoint = glob.glob(str(tmp_path / "fit" / "**" / "checkpoints" / "last.ckpt"), recursive=True)[0]
    run_cli("tiny_arith", "--ckpt_path", checkpoint, "--model.evaluation.num_samples", "4",
            "--model.evaluation.temperature",
            "1.0", command="test", root=tmp_path / "test")
    report = json.loads(open(checkpoint.replace(".ckpt", ".test.json")).read())
    metrics = report["metrics"]
    assert sorted(metrics) == ["test/maj@4", "test/mean@4", "test/pass@1", "test/pass@2", "test/pass@4"]
    assert report["eval_num_samples"] == 4 and report["ckpt_path"] == checkpoint
    assert 0 <= metrics["test/pass@1"] <= metrics["test/pass@2"] <= metrics["test/pass@4"] <= 1
    assert metrics["test/mean@4"] == metrics["test/pass@1"]  # 0/1 rewards: the mean is pass@1's estimate

"""Multi-turn episodes through the command line: a fit with tools draws episodes over the in-process engine in every
training mode, trains, evaluates and logs what the episodes did."""

import math

import pytest

from conftest import TOOL_TASK


@pytest.mark.parametrize("config, extra", [
    ("configs/tiny_arith.yaml", []),
    ("configs/tiny_arith_dense.yaml", ["--trainer.strategy.init_args.dense.lr", "1e-3"]),
    ("configs/tiny_arith_lora.yaml", []),
], ids=["sketch", "dense", "lora"])
def test_a_fit_with_tools_draws_episodes_trains_and_logs_them(run_cli, config, extra):
    cli = run_cli(config, *TOOL_TASK, *extra)  # 4 prompts, 32 episodes a step
    metrics = cli.trainer.logged_metrics
    assert cli.trainer.global_step == 2
    # the shipped model calls the tool in about a quarter of its episodes: some episodes took a second turn
    assert 1.0 < metrics["episodes/turns"] <= 2.0 and metrics["episodes/tool_calls"] > 0
    assert metrics["episodes/environment_tokens"] > 0 and metrics["episodes/sampled_tokens"] > 0
    assert metrics["train/reward_mean"] > 0 and metrics["train/grad_norm"] > 0
    for key in ("episodes/tool_errors", "episodes/invalid_calls", "episodes/environment_s", "val/pass@1"):
        assert math.isfinite(float(metrics[key])), key


def test_an_environment_class_draws_episodes_and_scores_them(run_cli, tool_model):
    cli = run_cli("configs/tiny_arith.yaml", "--model.episodes.environment_factory", "bad_envs.Counter",
                  "--model.reward",
                  "[exact_match, "
                  "environment]", "--model.episodes.max_turns", "3", "--model.sampling.max_new_tokens", "10",
                  "--model.episodes.max_tokens", "48", model=tool_model)
    metrics = cli.trainer.logged_metrics
    assert cli.trainer.global_step == 2 and metrics["episodes/sampled_tokens"] > 0
    for key in ("episodes/turns", "episodes/tool_calls", "episodes/environment_s", "train/reward_mean", "val/pass@1"):
        assert math.isfinite(float(metrics[key])), key

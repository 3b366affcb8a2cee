"""Callbacks for the runs of several ranks with a vLLM engine each (tests/integration/vllm/test_ddp_vllm.py and
test_fsdp_vllm.py), named by dotted path on their command lines ("engine_ranks.…"): what each rank's engine sampled
and holds, written as rank<r>.json in the run's root directory; and a SIGKILL of one rank mid-run."""

import json
import os
import signal
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Callback

from lightning_logra.base.hashing import prompt_seeds
from lightning_logra.rollout.sync import whole

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
    - after the first step, rank 1 shifts one entry of a trained weight in its engine by 1e-3: the next sync's check
      must find and repair it, and the logged difference is the largest of any rank's;
    - at the end, the largest |engine weight − trainer weight| over every policy tensor, the loads its
      RolloutWeightSync made, its engine's processes (as the engine finds them) and the trainer's variables found in
      their environment."""

    def __init__(self) -> None:
        self.report: dict = {}
        self.steps = 0  # of this run (a resumed run's first batch is not batch 0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.steps > 0:
            return
        n, count = pl_module.hparams.sampling.num_generations, len(batch["prompt"])
        everyone: list = [None] * trainer.world_size
        dist.all_gather_object(everyone, list(batch["prompt"]))
        prompts = [p for rank_prompts in everyone for p in rank_prompts]
        # One process with one engine: the whole batch in one call, prompt j seeded by its global index j.
        together = pl_module.engine.generate(pl_module.encode_prompts(prompts), n, pl_module.sampling,
                                             prompt_seeds(pl_module.hparams.sampling.seed, 0, 0, len(prompts)))
        mine = pl_module.generate(batch, n, pl_module.sampling, 0)
        self.report["samples"] = _rows(mine, 0, count * n)
        self.report["same_samples"] = _rows(together, trainer.global_rank * count * n, count * n) == _rows(mine, 0,
                                                                                                        count * n)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # Listed after RolloutWeightSync: this step's check has run; the next step's must catch this.
        self.steps += 1
        if self.steps != 1:
            return
        # Every rank asks (a tensor-parallel engine's workers answer together); rank 1 alone changes what it holds.
        weight = pl_module.engine.weights([DRIFTED])[DRIFTED][: pl_module.policy.get_parameter(DRIFTED).shape[0]]
        if trainer.global_rank == 1:
            # Column 100 of o_proj (a row-parallel layer): in rank 1's shard of a 2-way tensor-parallel engine too.
            weight[3, 100] += 1e-3
            pl_module.engine.load_weights({DRIFTED: weight})

    def on_train_end(self, trainer, pl_module):
        params = {n: p for n, p in pl_module.policy.named_parameters() if not n.endswith(".sketch_param")}
        theirs = pl_module.engine.weights(list(params))
        # Sharded (FSDP) weights are gathered whole here, every rank taking part, to compare them entry by entry.
        self.report["max_weight_diff"] = max(
            float((theirs[name][: p.shape[0]] - whole(p.detach())).abs().max()) for name, p in params.items())
        self.report["weight_dtypes"] = sorted({str(theirs[name].dtype) for name in params})
        sync = next(c for c in trainer.callbacks if type(c).__name__ == "RolloutWeightSync")
        self.report.update(loads=sync.loads, syncs=sync.syncs, restarts=pl_module.engine.restarts)
        engines = pl_module.engine._engine_processes()  # what it would measure, and kill if it stalled
        self.report["engine_pids"] = [p.pid for p in engines]
        views = pl_module.engine.llm.collective_rpc(_engine_view)
        self.report["leaked"] = sorted({v for view in views for v in view["variables"]})
        self.report["engine_world_sizes"] = [view["world_size"] for view in views]
        self.report["engine_cores"] = [view["cores"] for view in views]
        self.report["trainer_had"] = sorted(v for v in TRAINER_VARIABLES if v in os.environ)
        path = Path(trainer.default_root_dir) / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.report))




class KillRankAt(Callback):
    """SIGKILL this process once step `step` is done, on rank `rank` alone: the run dies mid-way, as on a lost node."""

    def __init__(self, step: int = 3, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)

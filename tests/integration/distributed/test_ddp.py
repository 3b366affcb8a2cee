"""Two CPU processes (gloo) against one process on the same global batch, through the CLI."""

import glob
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import CONFIGS, TOOL_TASK
from golden import assert_matches, observe, recorded
from lightning_logra.data.tool_task import TOOLS_DIR


def _fit(run_cli, config: str, root: Path, steps: int = 3, wait: bool = True):
    """A tiny run in processes of its own (validating once, at its end), checked by conftest's callbacks; returns the
    weights it exported, or with `wait=False` the running process (`_finish` waits for it)."""
    run = run_cli(config, "--trainer.val_check_interval", str(steps), "--data.init_args.eval_limit", "4",
                  "--model.export.dir", str(root / "export"), "--trainer.callbacks+=conftest.NoDenseSketchGradients",
                  "--trainer.callbacks+=conftest.GradNormAtMost",  # the config clips at 1.0; these norms are about 3
                  "--trainer.callbacks+=conftest.GradNormLog", steps=steps, root=root, subprocess=True, wait=wait)
    return load_file(root / "export" / "model.safetensors") if wait else run


def _finish(run, root: Path) -> dict[str, torch.Tensor]:
    """The weights a run `_fit` started without waiting exported, once it succeeded."""
    assert run.wait(timeout=600) == 0, (root / "out.log").read_text()[-3000:]
    return load_file(root / "export" / "model.safetensors")


def _grad_norms(root: Path) -> list[float]:
    """Each step's gradient norm before clipping, as conftest.GradNormLog wrote it in `_fit`."""
    return json.loads((root / "grad_norms.json").read_text())


def _scalars(root: Path, tag: str) -> list[float]:
    """One scalar's values, in step order, from the TensorBoard log of a run in `root` (rank 0 writes it)."""
    events = EventAccumulator(glob.glob(str(root / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def test_two_processes_equal_one_process_on_the_same_global_batch(run_cli, tiny_arith_model, tmp_path):
    # With the configs' KL control (subset: 16 of the global batch's 32 responses): both runs measure q on the same
    # responses, so they take the same α.
    # The one-process run beside the two-process one: 3 processes of one thread each on 2 cores take less time than
    # one run after the other, and neither's numbers depend on the other.
    running = _fit(run_cli, "tiny_arith", tmp_path / "1", wait=False)
    double = _fit(run_cli, "tiny_arith_ddp", tmp_path / "2")
    single = _finish(running, tmp_path / "1")
    assert_matches("tiny_arith_ddp", observe(tmp_path / "2", tiny_arith_model, tmp_path / "2" / "export"),
                   recorded("tiny_arith_ddp"))
    start = load_file(Path(tiny_arith_model) / "model.safetensors")
    moved = [name for name in single if not torch.equal(single[name], start[name])]
    assert any("q_proj" in name for name in moved)  # the runs did train
    assert _grad_norms(tmp_path / "2") == pytest.approx(_grad_norms(tmp_path / "1"), rel=1e-5)
    for name in single:
        torch.testing.assert_close(double[name], single[name], rtol=1e-5, atol=1e-6)
    # each reward's mean and std are over the global batch (a mean of the ranks' stds would differ)
    for tag in ("reward/odd_first_digit/mean", "reward/odd_first_digit/std", "train/reward_mean"):
        one, two = _scalars(tmp_path / "1", tag), _scalars(tmp_path / "2", tag)
        assert len(one) == 3 and two == pytest.approx(one, rel=1e-6), tag
    # q over the same responses (the weights agree to 1e-5 relative; a subset drawn per rank moved α by 10%)
    for tag in ("kl/q", "kl/alpha", "kl/realized"):
        one, two = _scalars(tmp_path / "1", tag), _scalars(tmp_path / "2", tag)
        assert len(one) == 3 and two == pytest.approx(one, rel=1e-5), tag


def _dense_on_two_processes(path: Path) -> str:
    # tiny_arith_dense_all.yaml on 2 processes: DenseDDPStrategy, Lightning's DDP wrapper (gloo on CPU), averages the
    # gradients inside every backward; the data module shards each step's prompts itself.
    data = yaml.safe_load((CONFIGS / "tiny_arith_dense_all.yaml").read_text())
    dense = data["trainer"]["strategy"]["init_args"]["dense"]
    data["trainer"].update(devices=2, use_distributed_sampler=False, strategy={
        "class_path": "lightning_logra.train.strategies.DenseDDPStrategy",
        "init_args": {"dense": dense, "process_group_backend": "gloo"}})
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.long  # two more runs of 2 and 1 processes, about a minute; the fast tier has the sketch DDP run
def test_dense_ddp_equals_one_process_on_the_same_global_batch(run_cli, tiny_arith_model, tmp_path):
    # Each rank's loss is normalized by the global batch's counts, so the ranks' gradients must be summed; the DDP
    # wrapper averages them, and the module multiplies its loss by the world size to undo that. AdamW is invariant to
    # the gradients' scale and the config clips their norm (above 2 here) to 1, so the weights alone would not notice a
    # missing factor: the gradient norms before clipping are compared too.
    single = _fit(run_cli, "tiny_arith_dense_all", tmp_path / "1")
    double = _fit(run_cli, _dense_on_two_processes(tmp_path / "dense_ddp.yaml"), tmp_path / "2")
    assert_matches("dense_ddp", observe(tmp_path / "2", tiny_arith_model, tmp_path / "2" / "export"),
                   recorded("dense_ddp"))
    norms = _grad_norms(tmp_path / "1")
    assert len(norms) == 3 and min(norms) > 1.0  # three steps, each clipped
    assert _grad_norms(tmp_path / "2") == pytest.approx(norms, rel=1e-5)
    start = load_file(Path(tiny_arith_model) / "model.safetensors")
    assert all(not torch.equal(single[name], start[name]) for name in single)  # AdamW moved every weight
    for name in single:
        torch.testing.assert_close(double[name], single[name], rtol=1e-5, atol=1e-6)


@pytest.mark.long  # two runs of 2 and 1 processes, about a minute
def test_dynamic_sampling_on_two_ranks_keeps_and_trains_what_one_process_does(run_cli, tiny_arith_model, tmp_path):
    # Two completions per prompt: about half the groups are all-equal and left out, so steps take more rounds, and
    # the ranks keep different numbers of groups (each keeps those it drew). The DDP wrapper makes every backward a
    # collective: the rank with fewer micro-batches runs the rest on a row whose tokens count zero.
    extra = ["--model.rollouts.dynamic_sampling", "true", "--model.rollouts.max_generation_rounds", "3",
             "--model.sampling.num_generations", "2",
             "--model.training.micro_batch_size", "2"]
    data = yaml.safe_load(Path(_dense_on_two_processes(tmp_path / "dense_ddp.yaml")).read_text())
    data["model"]["rollouts"] = {"dynamic_sampling": True, "max_generation_rounds": 3}
    data["model"]["sampling"]["num_generations"] = 2
    data["model"]["training"]["micro_batch_size"] = 2
    (tmp_path / "ds_ddp.yaml").write_text(yaml.safe_dump(data))
    single = _fit(lambda config, *o, **k: run_cli(config, *o, *extra, **k), "tiny_arith_dense_all", tmp_path / "1")
    double = _fit(run_cli, str(tmp_path / "ds_ddp.yaml"), tmp_path / "2")
    rounds = _scalars(tmp_path / "1", "rollout/generation_rounds")
    assert len(rounds) == 3 and max(rounds) > 1  # the steps drew more prompts
    for tag in ("rollout/generation_rounds", "rollout/filtered_groups", "rollout/missing_groups",
                "train/reward_mean", "reward/odd_first_digit/mean", "train/grad_norm"):
        assert _scalars(tmp_path / "2", tag) == pytest.approx(_scalars(tmp_path / "1", tag), rel=1e-5), tag
    assert _scalars(tmp_path / "1", "train/frac_reward_zero_std") == [0.0, 0.0, 0.0]  # only learnable groups trained
    for name in single:
        torch.testing.assert_close(double[name], single[name], rtol=1e-5, atol=1e-6)


@pytest.mark.long  # two runs of 2 and 1 processes, about a minute
def test_episodes_on_two_ranks_train_what_one_process_does(run_cli, tmp_path):
    # Multi-turn episodes with the shipped tool model, which calls the tool in a quarter of them: each rank runs its
    # slice's episodes (its own environment processes), and the sampling seeds are the prompts' global indices, so the
    # two ranks draw the episodes one process draws; the sums over sampled tokens are over the global batch.
    def fit(config, *overrides, **kwargs):
        return run_cli(config, *overrides, *TOOL_TASK, **kwargs)

    running = _fit(fit, "tiny_arith", tmp_path / "1", steps=2, wait=False)
    double = _fit(fit, "tiny_arith_ddp", tmp_path / "2", steps=2)
    single = _finish(running, tmp_path / "1")
    assert len(_scalars(tmp_path / "1", "episodes/tool_calls")) == 2
    assert max(_scalars(tmp_path / "1", "episodes/turns")) > 1.0  # some episodes called the tool and went on
    for tag in ("episodes/turns", "episodes/tool_calls", "episodes/sampled_tokens", "episodes/environment_tokens",
                "train/reward_mean", "train/grad_norm"):
        assert _scalars(tmp_path / "2", tag) == pytest.approx(_scalars(tmp_path / "1", tag), rel=1e-5), tag
    start = load_file(TOOLS_DIR / "model.safetensors")
    assert any(not torch.equal(single[name], start[name]) for name in single if "q_proj" in name)
    for name in single:
        torch.testing.assert_close(double[name], single[name], rtol=1e-5, atol=1e-6)

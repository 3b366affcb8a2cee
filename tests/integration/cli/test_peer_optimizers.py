"""The optimizers a user would pick instead of LoGRA, each by `trainer.strategy.init_args.dense.optimizer` through the
command line: three steps of the dense baseline (the LoRA adapters for 8-bit AdamW) at settings from its own paper, a
step-size controller scaling a GaLore step, and a GaLore run resumed from its checkpoint equal to the uninterrupted one.
A package that does not install on this machine skips its case, saying which (the `peers` extra installs them all)."""

import glob
import importlib.util
import json
import math

import pytest
import torch

from conftest import CONFIGS

PEERS = {  # class path, init_args (the tiny model's matrices are 64 to 256 wide: rank 8, not the papers' 128+)
    "galore": ("galore_torch.GaLoreAdamW", {"rank": 8, "update_proj_gap": 2, "scale": 0.25,
                                           "no_deprecation_warning": True}),
    "galore_adafactor": ("galore_torch.GaLoreAdafactor", {"rank": 8, "scale_parameter": False,
                                                          "relative_step": False}),
    "fira": ("fira.FiraAdamW", {"rank": 8, "alpha": 1.0, "no_deprecation_warning": True}),
    "apollo": ("apollo_torch.APOLLOAdamW", {"rank": 8, "scale_type": "channel", "scale": 1.0}),
    "apollo_mini": ("apollo_torch.APOLLOAdamW", {"rank": 1, "scale_type": "tensor", "scale": 128}),
    "flora": ("flora_opt.Flora", {"rank": 8, "beta1": 0.9, "kappa": 1000, "relative_step": False,
                                  "scale_parameter": False}),
    "adafactor": ("transformers.optimization.Adafactor", {"scale_parameter": False, "relative_step": False,
                                                          "warmup_init": False}),
    "adamw_8bit": ("bitsandbytes.optim.AdamW8bit", {"min_8bit_size": 0}),
}


def _spec(name: str, **more) -> str:
    class_path, init_args = PEERS[name]
    if importlib.util.find_spec(class_path.split(".")[0]) is None:
        pytest.skip(f"{class_path.split('.')[0]} does not install on this machine (pip install -e .[peers])")
    return json.dumps({"class_path": class_path, "init_args": {"lr": 1e-3, **init_args, **more}})


def _weights(cli) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in cli.model.policy.named_parameters()}


@pytest.mark.parametrize("name", list(PEERS))
def test_three_dense_steps(run_cli, tiny_arith_model, tmp_path, name):
    from transformers import AutoModelForCausalLM

    cli = run_cli("tiny_arith_dense", "--trainer.strategy.init_args.dense.optimizer", _spec(name),
                  "--trainer.limit_val_batches", "0", steps=3,
                  root=tmp_path)
    assert cli.trainer.global_step == 3
    optimizer = cli.trainer.optimizers[0]
    assert f"{type(optimizer).__module__}.{type(optimizer).__name__}".startswith(PEERS[name][0].split(".")[0])
    start = AutoModelForCausalLM.from_pretrained(tiny_arith_model).state_dict()
    after = _weights(cli)
    trained = [n for n, p in cli.model.policy.named_parameters() if p.requires_grad]
    assert trained and all(torch.isfinite(after[n]).all() for n in after)
    assert all(not torch.equal(after[n], start[n]) for n in trained)  # every trained matrix moved
    assert all(torch.equal(after[n], start[n]) for n in after if n not in trained)  # the frozen rest did not
    assert torch.load(glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)[0], weights_only=False)[
        "lightning_logra"]["optimizer"] == PEERS[name][0]


def test_8bit_adamw_trains_lora_adapters(run_cli, tmp_path):
    cli = run_cli("tiny_arith_lora", "--trainer.strategy.init_args.lora.optimizer", _spec("adamw_8bit"),
                  "--trainer.limit_val_batches", "0",
                  "--trainer.strategy.init_args.lora.rank", "1", "--trainer.strategy.init_args.lora.lr", "2e-3",
                  steps=3, root=tmp_path)
    optimizer = cli.trainer.optimizers[0]
    assert type(optimizer).__name__ == "AdamW8bit" and optimizer.defaults["lr"] == 1e-3  # init_args win over lora.lr
    assert all(p.dtype == torch.uint8 for state in optimizer.state.values() for key, p in state.items()
               if key in ("state1", "state2"))
    adapters = [p for n, p in cli.model.policy.named_parameters() if "lora_B" in n]
    assert adapters and all(p.abs().sum() > 0 for p in adapters)  # B starts at zero


def test_a_step_size_controller_scales_a_galore_step(run_cli, tmp_path):
    budget = json.dumps([{"class_path": "lightning_logra.callbacks.PredictedKLBudget",
                          "init_args": {"budget": 1e-4, "alpha_max": 4.0, "subset": 4}}])
    run_cli("tiny_arith_dense", "--trainer.strategy.init_args.dense.optimizer", _spec("galore"), "--trainer.callbacks",
            budget,
            "--trainer.limit_val_batches", "0", steps=3, root=tmp_path)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    alphas = [e.value for e in events.Scalars("kl/alpha")]
    assert len(alphas) == 3 and all(math.isfinite(a) and 0 < a <= 4.0 for a in alphas)


def test_a_resumed_galore_run_equals_the_uninterrupted_one(run_cli, tmp_path):
    spec = _spec("galore")
    common = ("--trainer.strategy.init_args.dense.optimizer", spec, "--trainer.limit_val_batches", "0")
    straight = run_cli("tiny_arith_dense", *common, steps=3, root=tmp_path / "a")
    run_cli("tiny_arith_dense", *common, steps=2, root=tmp_path / "b")
    checkpoint = glob.glob(str(tmp_path / "b" / "**" / "last.ckpt"), recursive=True)[0]
    resumed = run_cli("tiny_arith_dense", *common, "--ckpt_path", checkpoint, steps=3, root=tmp_path / "c")
    # update_proj_gap 2: step 3 recomputes the projection from its SVD; the projectors came back from the checkpoint
    a, b = _weights(straight), _weights(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_sketch_run_has_no_dense_optimizer(run_cli, capsys):
    # A sketch strategy's optimizer is its sketch.optimizer: a dense one given beside it is an unknown key.
    with pytest.raises(SystemExit):
        run_cli(CONFIGS / "tiny_arith.yaml", "--trainer.strategy.init_args.dense.optimizer", "torch.optim.SGD",
                run=False)
    assert "unrecognized arguments: --dense.optimizer" in capsys.readouterr().err

"""Settings refused before anything expensive: bad sketch settings fail right after the model's config.json is read
(no weights, no data set-up, no engine), options that would be ignored are refused, and every option is documented
in --help."""

import dataclasses
import inspect
import math
import re

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from lightning_logra.base.schedule import LRSchedule
from lightning_logra.cli import main
from lightning_logra.data.module import ArithDataModule
from lightning_logra.episodes.settings import EpisodeSettings
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.dense import DenseConfig
from lightning_logra.train.modes import training_mode
from lightning_logra.train.module import RLVRModule
from lightning_logra.train.settings import GROUPS
from lightning_logra.train.strategies import Collectives

KEY = "trainer.strategy.init_args.sketch"


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fails the test if the policy's weights are loaded or the data module is set up."""

    def load_weights(*args, **kwargs):
        raise AssertionError("the policy's weights were loaded")

    def set_up_data(*args, **kwargs):
        raise AssertionError("the data module was set up")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load_weights)
    monkeypatch.setattr(ArithDataModule, "setup", set_up_data)


# The test model (tiny_arith_model): q/k/v/o/gate/up read 128 inputs, down_proj 256; lm_head is tied to the embedding.
@pytest.mark.parametrize("override, error, message", [
    (["--trainer.strategy.init_args.sketch.rank", "0"], ValueError,
     f"{KEY}.rank must be a positive integer (the rank r of each d×r sketch, smaller than in_features of every "
     "target), got 0"),
    (["--trainer.strategy.init_args.sketch.rank", "-3"], ValueError, f"{KEY}.rank must be a positive integer"),
    (["--trainer.strategy.init_args.sketch.rank", "128"], ValueError,
     f"{KEY}.rank: 128 must be smaller than in_features=128 of 'model.layers.0.self_attn.q_proj': the d×r sketch "
     "replaces the d×k gradient, so it saves memory only when r < k; lower the rank below 128 or drop 'q_proj' from "
     "target_modules"),
    (["--trainer.strategy.init_args.sketch.target_modules", "[qq_proj]"], ValueError,
     f"{KEY}.target_modules: 'qq_proj' matches no module of Qwen2ForCausalLM; linear layers it has: ['down_proj', "
     "'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']"),
    (["--trainer.strategy.init_args.sketch.target_modules", "[mlp]"], TypeError,
     f"{KEY}.target_modules: 'mlp' matches 'model.layers.0.mlp', a Qwen2MLP, not an nn.Linear; use a more specific "
     "pattern"),
    (["--trainer.strategy.init_args.sketch.target_modules", "[lm_head]"], ValueError,
     f"{KEY}.target_modules: the weight of 'lm_head' is shared by ['model.embed_tokens.weight', 'lm_head.weight']"),
    (["--trainer.strategy.init_args.sketch.target_modules", "[]"], ValueError, f"{KEY}.target_modules is empty"),
], ids=["rank 0", "negative rank", "rank = k", "unknown target", "not a Linear", "tied weight", "no targets"])
def test_bad_sketch_settings_fail_before_weights_or_data_load(run_cli, nothing_loads, override, error, message):
    with pytest.raises(error) as info:
        run_cli("tiny_arith", *override)
    assert message in str(info.value)


def test_the_largest_rank_that_fits_passes_the_checks(run_cli, nothing_loads):
    # rank 127 < k = 128 for every target: the check's boundary is exactly the installer's rule r < k.
    cli = run_cli("tiny_arith", "--trainer.strategy.init_args.sketch.rank", "127", run=False)
    assert cli.trainer.strategy.config.rank == 127 and cli.model.policy is None


@pytest.mark.parametrize("override, message", [
    (["--model.lr", "1e-3"], "(model.lr is now trainer.strategy.init_args.dense.lr (with DenseStrategy"),
    (["--model.beta", "0.1"], "(model.beta is now model.loss.beta)"),
    (["--config", "old.yaml"], "(model.temperature is now model.sampling.temperature)"),
    # the dense run's settings are its strategy's: a sketch strategy has none
    (["--trainer.strategy.init_args.dense.lr", "1e-3"], "dense.lr"),
], ids=["lr", "beta", "old config file", "dense under sketch"])
def test_a_setting_of_the_old_shape_names_its_new_key(run_cli, tmp_path, capsys, monkeypatch, override, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.yaml").write_text("model:\n  temperature: 0.5\n")
    with pytest.raises(SystemExit) as info:
        run_cli("tiny_arith", *override, run=False)
    assert info.value.code != 0 and message in capsys.readouterr().err


def test_a_dense_run_takes_its_optimizer_settings_from_its_strategy(run_cli):
    dense = run_cli("tiny_arith_dense", "--trainer.strategy.init_args.dense.lr", "1e-3",
                    "--trainer.strategy.init_args.dense.lr_schedule.warmup_steps", "5", run=False)
    config = dense.trainer.strategy.config
    assert (config.lr, config.lr_schedule, config.target_modules[0]) == (1e-3, LRSchedule(warmup_steps=5), "q_proj")
    optimizers, schedulers = training_mode(dense.trainer.strategy, Collectives()).build_optimizers(
        AutoModelForCausalLM.from_pretrained(dense.model.hparams.model))
    assert type(optimizers[0]) is torch.optim.AdamW and optimizers[0].defaults["lr"] == 1e-3


@pytest.mark.parametrize("option", [["--optimizer", "torch.optim.Adam"],
                                    ["--lr_scheduler", "torch.optim.lr_scheduler.StepLR"]])
def test_lightning_cli_optimizer_options_do_not_exist(run_cli, capsys, option):
    # LightningCLI's own --optimizer / --lr_scheduler would be accepted and dropped (the strategy or the module
    # builds the optimizers, and Lightning steps no scheduler under manual optimization): they are not offered.
    with pytest.raises(SystemExit):
        run_cli("tiny_arith", *option)
    assert f"unrecognized arguments: {option[0]}" in capsys.readouterr().err


def _help_entries(text: str) -> dict[str, str]:
    """{option: what --help says about it}: an entry starts at a line "  --option ..." and goes on over the lines
    indented further."""
    entries: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  --"):
            name, _, rest = line.strip().partition(" ")
            current = entries.setdefault(name.rstrip(","), [rest])
        elif current is not None and line.startswith("    "):
            current.append(line.strip())
        else:
            current = None
    return {name: " ".join(lines) for name, lines in entries.items()}


def _description_words(entry: str) -> int:
    """Words of prose in a help entry, leaving out the metavar (LR, {true,false}, [ITEM,...]) and the type line."""
    prose = re.split(r"\((required, )?type: ", entry)[0]
    return sum(bool(re.fullmatch(r"[a-z][a-z'-]*", word.strip(".,;:()"))) for word in prose.split())


def test_every_module_and_sketch_option_has_a_description_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    module_help = _help_entries(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main(["fit", "--trainer.strategy.help", "lightning_logra.train.strategies.SketchStrategy"])
    strategy_help = _help_entries(capsys.readouterr().out)
    with pytest.raises(SystemExit):  # a group that may be null has a help of its own
        main(["fit", "--model.episodes.help"])
    module_help.update(_help_entries(capsys.readouterr().out))

    schedule = [f.name for f in dataclasses.fields(LRSchedule)]
    module = [f"--model.{name}" for name in inspect.signature(RLVRModule.__init__).parameters
              if name not in ("self", "episodes", *GROUPS)]
    module += [f"--model.{group}.{f.name}" for group, kind in GROUPS.items() for f in dataclasses.fields(kind)]
    module += [f"--model.episodes.{f.name}" for f in dataclasses.fields(EpisodeSettings)]
    sketch = [f"--trainer.strategy.sketch.{f.name}" for f in dataclasses.fields(SketchConfig)
              if f.name != "lr_schedule"]
    sketch += [f"--trainer.strategy.sketch.lr_schedule.{name}" for name in schedule]
    assert set(module) <= set(module_help) and set(sketch) <= set(strategy_help)
    undocumented = [o for o in module if _description_words(module_help[o]) < 3]
    undocumented += [o for o in sketch if _description_words(strategy_help[o]) < 3]
    assert not undocumented
    assert not any(o.startswith(("--optimizer", "--lr_scheduler")) for o in module_help)


def test_a_kl_penalty_under_fsdp_is_refused_before_the_processes_start(run_cli, nothing_loads):
    # The reference would be a whole copy of the weights on every rank: refused by the CLI's checks, before
    # `fit` launches the ranks or anything loads (configure_model refuses it too, for a module used without the CLI).
    with pytest.raises(ValueError, match=r"model\.loss\.beta=0\.04: .*unsharded copy .*SketchDDPStrategy"):
        run_cli("tiny_arith_fsdp", "--model.loss.beta", "0.04")


def _float_settings(cls: type) -> list[str]:
    """The settings of `cls` a config may set to a float: the parameters of its constructor (a dataclass's fields)
    whose type admits one."""
    return [name for name, p in inspect.signature(cls).parameters.items() if re.search(r"\bfloat\b", str(p.annotation))]


def _set(cls: type, value: float, key: str, expected: set[str]) -> dict:
    """Every float setting of `cls` at `value`, as init_args; their keys under `key` added to `expected`."""
    settings = {}
    for name in _float_settings(cls):
        if re.search(r"(list|tuple)\[", str(inspect.signature(cls).parameters[name].annotation)):  # each entry
            settings[name] = [value, value]
            expected.update({f"{key}.{name}[0]", f"{key}.{name}[1]"})
        else:
            settings[name] = value
            expected.add(f"{key}.{name}")
    return settings


@pytest.mark.parametrize("strategy", ["sketch", "lora", "dense"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_setting_of_every_config_class_refuses_nan_and_infinity(run_cli, tmp_path, strategy, value):
    # A config file's .nan / .inf in every float setting of the module, its engine and schedule, each callback, the
    # strategy's settings, its sketch optimizer and schedule: one error names every one of them, before any class is
    # built (the command line refuses `nan` itself; YAML does not).
    from lightning_logra.callbacks import KLFromStart, MemoryProfiler, PredictedKLBudget, RolloutWeightSync
    from lightning_logra.rollout import VLLMEngine
    from lightning_logra.sketch import SketchAdam
    from lightning_logra.train.lora import LoRAConfig

    expected: set[str] = set()
    model = {group: _set(kind, value, f"model.{group}", expected) for group, kind in GROUPS.items()}
    model["episodes"] = _set(EpisodeSettings, value, "model.episodes", expected)
    model["rollouts"]["engine"] = {"class_path": "lightning_logra.rollout.VLLMEngine",
                                   "init_args": _set(VLLMEngine, value, "model.rollouts.engine.init_args", expected)}
    callbacks = [{"class_path": f"lightning_logra.callbacks.{cls.__name__}",
                  "init_args": _set(cls, value, f"trainer.callbacks[{index}].init_args", expected)}
                 for index, cls in enumerate([PredictedKLBudget, KLFromStart, MemoryProfiler, RolloutWeightSync])]
    assert all(callback["init_args"] for callback in callbacks[:1] + callbacks[2:])  # (KLFromStart has none)
    if strategy == "sketch":
        key = "trainer.strategy.init_args.sketch"
        settings = _set(SketchConfig, value, key, expected)
        settings["optimizer"] = {"class_path": "lightning_logra.sketch.SketchAdam",
                                 "init_args": _set(SketchAdam, value, f"{key}.optimizer.init_args", expected)}
        settings["lr_schedule"] = _set(LRSchedule, value, f"{key}.lr_schedule", expected)
        strategy_config = {"class_path": "lightning_logra.train.strategies.SketchStrategy",
                           "init_args": {"sketch": settings}}
    elif strategy == "dense":
        key = "trainer.strategy.init_args.dense"
        settings = _set(DenseConfig, value, key, expected)
        settings["lr_schedule"] = _set(LRSchedule, value, f"{key}.lr_schedule", expected)
        strategy_config = {"class_path": "lightning_logra.train.strategies.DenseStrategy",
                           "init_args": {"dense": settings}}
    else:
        key = "trainer.strategy.init_args.lora"
        settings = _set(LoRAConfig, value, key, expected)
        settings["lr_schedule"] = _set(LRSchedule, value, f"{key}.lr_schedule", expected)
        strategy_config = {"class_path": "lightning_logra.train.strategies.LoRAStrategy",
                           "init_args": {"lora": settings}}
    config = tmp_path / "non_finite.yaml"
    config.write_text(yaml.safe_dump({"model": model, "trainer": {"callbacks": callbacks,
                                                                  "strategy": strategy_config}}))
    assert len(expected) >= 20
    with pytest.raises(ValueError, match="a setting must be a finite number") as info:
        run_cli("tiny_arith", "--config", str(config), run=False)
    named = set(re.findall(r"([\w.\[\]]+)=-?(?:nan|inf)", str(info.value)))
    assert named == expected


@pytest.mark.parametrize("config, devices, strategy", [
    ("tiny_arith", ["--trainer.devices", "3"], "SketchDDPStrategy"),
    ("tiny_arith", ["--trainer.devices", "-1"], "SketchDDPStrategy"),
    ("tiny_arith", ["--trainer.num_nodes", "2"], "SketchDDPStrategy"),
    ("tiny_arith_lora", ["--trainer.devices", "2"], "set trainer.devices 1"),
])
def test_more_devices_than_a_one_device_strategy_trains_on_are_refused(run_cli, config, devices, strategy):
    # `--trainer.devices 3` with SketchStrategy trained on one device without a word.
    with pytest.raises(ValueError, match=rf"trainer.devices=.*trains on one device.*{strategy}"):
        run_cli(config, *devices, run=False)


@pytest.mark.parametrize("override, message", [
    # an unknown key, on the command line or in a config file, names the nearest ones it could be
    (["--model.temprature", "1.0"], "did you mean model.evaluation.temperature or model.sampling.temperature?"),
    (["--config", "typo.yaml"], "(did you mean model.evaluation.temperature or model.sampling.temperature?)"),
    # a seed numpy refuses: refused naming the key, not a traceback from inside Lightning
    (["--seed_everything", "99999999999999999999"], "seed_everything=99999999999999999999: a seed must be in [0, "
                                                    "4294967295]"),
])
def test_unknown_keys_and_seeds_out_of_range_fail_naming_the_fix(run_cli, tmp_path, capsys, monkeypatch, override,
                                                                  message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "typo.yaml").write_text("model:\n  temprature: 1.0\n")
    with pytest.raises(SystemExit) as info:
        run_cli("tiny_arith", *override, run=False)
    assert info.value.code != 0 and message in capsys.readouterr().err

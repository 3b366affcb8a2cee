"""The command line as a newcomer meets it: the `lightning-logra` console script, shipped configs and the embedded
model from any directory, `runs/<name>/latest` (the newest run's checkpoints), and no empty run folder left by a
failed run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from tensorboard.backend.event_processing import io_wrapper

from conftest import CONFIGS, ROOT, fast_overrides
from lightning_logra.callbacks import RunDirectory, SketchModelSummary, StepProgressBar
from lightning_logra.cli import main
from lightning_logra.paths import PACKAGE_DIR, config_path

EMBEDDED = "lightning_logra/data/tiny_arith"


@pytest.mark.parametrize("given", ["tiny_arith", "tiny_arith.yaml", "configs/tiny_arith.yaml"])
def test_shipped_configs_and_the_embedded_model_resolve_from_any_directory(run_cli, tmp_path, monkeypatch, given):
    monkeypatch.chdir(tmp_path)  # outside the repository: neither configs/ nor lightning_logra/ is here
    assert config_path(given) == str(CONFIGS / "tiny_arith.yaml")
    cli = run_cli(given, fast=False, run=False)
    assert cli.model.hparams.model == EMBEDDED  # kept as written: checkpoints stay portable
    cli.model.configure_model()  # loads the weights from the installed package
    assert cli.model.policy.name_or_path == str(PACKAGE_DIR / "data" / "tiny_arith")


def test_a_missing_model_path_still_names_the_key(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"model.model: no such model directory 'lightning_logra/data/tny'"):
        run_cli("tiny_arith", "--model.model", "lightning_logra/data/tny", fast=False, run=False)


def test_every_run_gets_the_step_bar_the_summary_and_the_run_directory_unless_told_otherwise():
    # (the flags themselves are what this checks: the one place outside conftest.py that sets them)
    config = str(CONFIGS / "tiny_arith.yaml")
    kinds = {type(c) for c in main(["--config", config], run=False).trainer.callbacks}
    assert {StepProgressBar, SketchModelSummary, RunDirectory} <= kinds
    # turned off, or named in the config, the defaults step aside (Lightning refuses a bar it was told not to show)
    quiet = main(["--config", config, "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary",
                  "false", "--trainer.logger", "false"], run=False).trainer.callbacks
    assert not {StepProgressBar, SketchModelSummary, RunDirectory} & {type(c) for c in quiet}
    own = main(["--config", config, "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"],
               run=False).trainer.callbacks
    assert [type(c) for c in own if isinstance(c, TQDMProgressBar)] == [TQDMProgressBar]


def test_an_engine_with_weights_of_its_own_gets_the_weight_sync_unless_the_config_lists_one():
    from lightning_logra.callbacks import RolloutWeightSync

    def syncs(config, *args):
        callbacks = main(["--config", str(CONFIGS / config), *args], run=False).trainer.callbacks
        return [c for c in callbacks if isinstance(c, RolloutWeightSync)]

    assert syncs("tiny_arith.yaml") == []  # the in-process engine is the policy: nothing to sync
    (added,) = syncs("tiny_arith.yaml", "--model.rollouts.engine", "lightning_logra.rollout.VLLMEngine")
    assert added.check_every == 50 and added.tolerance == 1e-4  # its defaults
    assert len(syncs("tiny_arith_vllm.yaml")) == 1  # the config's own, not a second beside it


def _versions(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "runs" / "tiny_arith").glob("version_*"))


def _latest(root: Path) -> str | None:
    link = root / "runs" / "tiny_arith" / "latest"
    return os.readlink(link) if link.is_symlink() else None


def test_latest_names_the_newest_run_and_failed_runs_leave_no_folder(run_cli, tmp_path):
    def run(*overrides):
        return run_cli("tiny_arith", "--trainer.val_check_interval", "1", *overrides, steps=1, root=tmp_path / "runs")

    # A bad setting caught at set-up: the folder Lightning created for the run is removed.
    with pytest.raises(ValueError, match="sketch.rank: 500"):
        run("--trainer.strategy.init_args.sketch.rank", "500")
    assert _versions(tmp_path) == [] and _latest(tmp_path) is None

    for _ in range(2):
        run()
    assert _versions(tmp_path) == ["version_0", "version_1"] and _latest(tmp_path) == "version_1/checkpoints"
    checkpoint = tmp_path / "runs/tiny_arith/latest/last.ckpt"  # the README's --ckpt_path
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 1
    # TensorBoard follows links: `latest` must not show up there as one more run
    runs = io_wrapper.GetLogdirSubdirectories(str(tmp_path / "runs"))
    assert sorted(Path(run).name for run in runs) == ["version_0", "version_1"]

    # Failing in its first step: the folder goes, and `latest` points back at the run before.
    with pytest.raises(ValueError, match="returned 31 rewards for 32 completions"):
        run("--model.reward", "bad_rewards.one_short")
    assert _versions(tmp_path) == ["version_0", "version_1"] and _latest(tmp_path) == "version_1/checkpoints"

    # A folder that was there before the run (a logger given an explicit version) is never removed.
    kept = tmp_path / "runs/tiny_arith/version_7"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="sketch.rank: 500"):
        run("--trainer.strategy.init_args.sketch.rank", "500", "--trainer.logger.init_args.version", "7")
    assert (kept / "notes.txt").read_text() == "mine"


def test_the_console_script_trains_the_embedded_default_from_any_directory(tmp_path):
    # What pip's generated `lightning-logra` script runs, from a folder outside the repository (so not through
    # conftest's run_cli, which runs cli.py in the repository); the package is the one under test (PYTHONPATH),
    # whichever copy this environment has installed, and conftest.py is importable for the test reward.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["lightning-logra"]
    module, function = target.split(":")
    script = f"import sys; from {module} import {function}; sys.exit({function}())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    # the model as the config names it, relative to the package; and the summary back on: its line is checked below
    args = fast_overrides(EMBEDDED, tmp_path / "runs", 1, "--trainer.val_check_interval", "1",
                          "--trainer.enable_model_summary", "true")
    run = subprocess.run([sys.executable, "-c", script, "fit", "--config", "tiny_arith", *args],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]  # a returned LightningCLI would exit 1
    checkpoint = torch.load(tmp_path / "runs/tiny_arith/latest/last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 1 and checkpoint["hyper_parameters"]["model"] == EMBEDDED
    assert "Trained params, sketched: 28 matrices at rank 16" in run.stderr


@pytest.mark.long  # two runs in processes of their own at once: about 30 s
def test_two_runs_started_at_once_on_one_folder_each_get_their_own(tiny_arith_model, tmp_path):
    # Each run as a user starts it, with its output apart (run_cli's own log would be one file for both).
    command = [sys.executable, "cli.py", "fit", "--config", "tiny_arith",
               *fast_overrides(tiny_arith_model, tmp_path / "runs", 1)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"out{i}.log" for i in range(2)]
    runs = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
            for log in logs]
    for process, log in zip(runs, logs):
        assert process.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert _versions(tmp_path) == ["version_0", "version_1"]
    for version in _versions(tmp_path):
        folder = tmp_path / "runs" / "tiny_arith" / version
        assert (folder / "config.yaml").is_file()
        assert torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 1
        assert len(list(folder.glob("events.out.tfevents.*"))) == 1  # one run's events each
    assert _latest(tmp_path) in ("version_0/checkpoints", "version_1/checkpoints")


def test_resuming_from_latest_finds_the_run_it_names_when_the_new_run_moves_it(run_cli, tmp_path):
    # A sharded (FSDP) checkpoint is restored after fitting starts, when `latest` already names the new run's empty
    # folder: the path is followed once, as given, before the run moves the link.
    one = ["--trainer.devices", "1", "--trainer.val_check_interval", "1"]
    run_cli("tiny_arith_fsdp", *one, steps=1, root=tmp_path / "runs")
    latest = tmp_path / "runs" / "tiny_arith_fsdp" / "latest" / "last.ckpt"
    assert latest.is_dir()  # sharded: a folder
    cli = run_cli("tiny_arith_fsdp", *one, "--ckpt_path", str(latest), steps=2, root=tmp_path / "runs")
    assert cli.trainer.global_step == 2
    assert os.readlink(tmp_path / "runs" / "tiny_arith_fsdp" / "latest") == "version_1/checkpoints"


def test_an_export_of_latest_reads_the_checkpoint_it_was_given_when_a_new_run_moves_the_link(run_cli, tmp_path,
                                                                                                monkeypatch):
    from lightning_logra import export

    run_cli("tiny_arith", "--trainer.val_check_interval", "1", steps=1, root=tmp_path / "runs")
    link = tmp_path / "runs" / "tiny_arith" / "latest"
    given = link / "last.ckpt"
    check_out = export._check_out

    def a_new_run_starts(out, overwrite, ckpt_path):  # as the export begins: `latest` now names an empty folder
        (tmp_path / "runs" / "tiny_arith" / "version_1" / "checkpoints").mkdir(parents=True)
        RunDirectory._point(link, "version_1/checkpoints")
        check_out(out, overwrite, ckpt_path)

    monkeypatch.setattr(export, "_check_out", a_new_run_starts)
    out = export.export_checkpoint(given, tmp_path / "exported")
    assert (out / "model.safetensors").is_file() and os.readlink(link) == "version_1/checkpoints"


def test_the_help_lists_every_command_and_no_predict(monkeypatch, capsys):
    # serve, export and fetch run before LightningCLI parses: the help names them beside fit, validate and test
    from lightning_logra.cli import console_main

    monkeypatch.setattr(sys, "argv", ["lightning-logra", "--help"])
    with pytest.raises(SystemExit) as exited:
        console_main()
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    for command in ("fit, validate, test", "export ", "serve ", "fetch "):
        assert f"\n  {command}" in shown, command
    assert "{fit,validate,test}" in shown  # predict has no meaning for a run's module

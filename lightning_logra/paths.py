"""Where the things the project ships are found, from any working directory: the embedded model (inside the
package) and the shipped configs (beside it, in the source checkout that the README's editable install uses).

The shipped configs write the embedded model as `lightning_logra/data/tiny_arith`, the path a reader sees in the
repository; `model_path` finds it in the installed package when the run starts somewhere else. A model that is no
local folder is a hub id: `check_hub_model` says at once when it cannot be had.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

PACKAGE_DIR = Path(__file__).resolve().parent
CONFIG_DIR = PACKAGE_DIR.parent / "configs"


def model_path(model: str) -> str:
    """`model.model` as a path to load from: as given when it exists from here (or is a hub id), else a path that
    starts with `lightning_logra/` is looked up inside the installed package."""
    if Path(model).exists():
        return model
    top, _, inside = model.partition("/")
    if top == PACKAGE_DIR.name and inside and (PACKAGE_DIR / inside).exists():
        return str(PACKAGE_DIR / inside)
    return model


def config_path(value: str) -> str:
    """A `--config` value as a file to read: as given when it exists from here, else a shipped config named by its
    name (`tiny_arith`), its file name (`tiny_arith.yaml`) or its path in the repository (`configs/tiny_arith.yaml`).
    Anything else is returned unchanged, for the parser to report."""
    if Path(value).exists():
        return value
    name = value.removeprefix(f"{CONFIG_DIR.name}/").removesuffix(".yaml")
    shipped = CONFIG_DIR / f"{name}.yaml"
    if "/" not in name and shipped.is_file():
        return str(shipped)
    return value


def shipped_configs() -> list[str]:
    """The names `--config` takes for the shipped configs (empty when the package is not run from a checkout)."""
    return sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))


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

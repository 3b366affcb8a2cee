"""Where the things the project ships are found, from any working directory: the embedded model (inside the
package) and the shipped configs (beside it, in the source checkout that the README's editable install uses).

The shipped configs write the embedded model as `lightning_logra/data/tiny_arith`, the path a reader sees in the
repository; `model_path` finds it in the installed package when the run starts somewhere else.
"""

from __future__ import annotations

from pathlib import Path

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

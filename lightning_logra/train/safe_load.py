"""Loading a checkpoint never runs code from it.

Checkpoints are shared between people and downloaded, and a pickle can call anything while it loads: a `.ckpt` with
an object whose `__reduce__` runs a command, or a sharded checkpoint folder whose `.metadata`
(torch.distributed.checkpoint reads it with plain `pickle`) or whose non-tensor entries (read with
`torch.load(weights_only=False)`) do. Every load path of the project goes through here:

- a file: `torch.load(weights_only=True)`, which builds only tensors, containers and primitives, plus the project's own
  classes that hyper-parameters pickle (`SAFE_GLOBALS`);
- a sharded folder: torch.distributed.checkpoint with a reader whose `.metadata` is unpickled by an unpickler that
  knows only the checkpoint format's own classes (`_MetadataUnpickler`) and a planner that loads non-tensor entries
  with `weights_only=True`.

What else a checkpoint would need is refused with an error that names it.
"""

from __future__ import annotations

import pathlib
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME
from torch.distributed.checkpoint import FileSystemReader, load
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lightning_logra.base.schedule import LRSchedule
from lightning_logra.episodes.settings import EpisodeSettings
from lightning_logra.rewards import MathAnswer, ReasoningGymScore
from lightning_logra.train.digests import SUMS, read_sums
from lightning_logra.train.settings import GROUPS

# What the hyper-parameters of a module may pickle: classes that are rebuilt as data (the settings groups, the schedule,
# MathAnswer's and ReasoningGymScore's settings). Nothing that runs: an
# allowed function is one a crafted checkpoint could call with arguments of its choosing (`math_answer` starts verifier
# processes). Hyper-parameters keep a reward function by its name (`rewards.reward_setting`); a checkpoint written when
# they kept the function itself loads with its name in its place, a string that nothing can call.
SAFE_GLOBALS: list[Any] = [
    LRSchedule, MathAnswer, ReasoningGymScore, EpisodeSettings, *GROUPS.values(),
    *[(name, f"lightning_logra.rewards.builtin.{name}") for name in ("exact_match", "math_answer")],
]

# The modules whose classes make up a torch.distributed.checkpoint `.metadata` file, and every module it may name
# (all imported already, with torch: naming them imports nothing new).
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                     "torch.distributed.checkpoint.planner")
_ALLOWED_MODULES = (*_METADATA_MODULES, "torch", "torch.serialization", "pathlib")


class UnsafeCheckpoint(ValueError):
    """A checkpoint whose loading would construct or call something other than plain data."""


class UnreadableCheckpoint(ValueError):
    """A checkpoint file whose zip archive torch cannot read (truncated, or with members where torch writes none)."""


def _refusal(path: Path | str, what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"{path}: refused to load: it pickles {what}, which is not plain data or one of lightning-logra's own "
        "classes, and loading it could run code. A checkpoint written by lightning-logra never needs it: use one "
        "from a source you trust. If this file is yours and holds an object of your own in its hyper-parameters, "
        "allow that class with torch.serialization.add_safe_globals([YourClass]) before loading it")


def load_file(file: Path | str | IO[bytes], map_location: Any = "cpu", where: Path | str | None = None) -> Any:
    """`torch.load` of a checkpoint file (a path, or an open file that `where` names) without running code from it."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message names the global it met ("... unsupported GLOBAL posix.system whose ..."): keep that.
        found = re.search(r"GLOBAL (\S+)", str(err))
        raise _refusal(where or file, found.group(1) if found else "something other than plain data") from None
    except TypeError as err:
        # An allowed name called (a reward kept by its name is a string; a class with arguments it does not take).
        raise UnsafeCheckpoint(f"{where or file}: refused to load: its pickle calls an allowed name as a lightning-"
                               f"logra checkpoint never does ({err}); use a checkpoint from a source you trust"
                               ) from None
    except RuntimeError as err:
        # torch's zip reader, in C++: a truncated file, or a member outside the archive's folder (which it refuses
        # to read rather than ignore). Its message starts with the source line that raised it.
        if "PytorchStreamReader" not in str(err) and "inline_container" not in str(err):
            raise
        reason = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", str(err).splitlines()[0])
        raise UnreadableCheckpoint(f"{where or file}: not a checkpoint file torch can read ({reason}); it is damaged "
                                   "or was not written by torch.save") from None


def check_sharded_folder(path: Path) -> None:
    """A sharded checkpoint folder holds its own files and nothing else: a folder or a link inside it was not written
    by a save, is not covered by its SHA256SUMS (a link would be checked as whatever it points to, anywhere), and a
    folder there could hold a module that an import from the checkpoint's folder would run. Refused, naming them."""
    strays = sorted(p.name for p in Path(path).iterdir() if p.is_symlink() or not p.is_file())
    if strays:
        raise UnsafeCheckpoint(f"{path}: refused to load: it holds {', '.join(repr(name) for name in strays)}, a "
                               f"folder or link that a save never writes and its SHA256SUMS does not cover. Use a "
                               f"checkpoint from a source you trust, or remove what does not belong in it")


def load_sharded(state: dict[str, Any], path: Path) -> None:
    """torch.distributed.checkpoint's `load` of `state` (in place) from the sharded checkpoint folder `path`."""
    with _refusals_raised(path):
        load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())


@contextmanager
def _refusals_raised(path: Path) -> Iterator[None]:
    """torch.distributed.checkpoint turns what a load raises into a CheckpointException of every rank's errors: a
    refusal is raised as itself. (A refused `.metadata` would come back as text only: it is read once first.)"""
    check_sharded_folder(path)
    SafeReader(path).read_metadata()
    try:
        yield
    except CheckpointException as err:
        for failure in err.failures.values():
            if isinstance(getattr(failure, "exception", None), UnsafeCheckpoint):
                raise failure.exception from None
        raise


def load_sharded_whole(path: Path) -> dict[str, Any]:
    """A whole sharded checkpoint folder as one checkpoint dict, read in this process (Lightning's consolidation:
    every tensor whole, plus the entries Lightning keeps beside the shards in `meta.pt`)."""
    checkpoint: dict[str, Any] = {}
    with _refusals_raised(path):
        _load_state_dict(checkpoint, storage_reader=SafeReader(path), planner=SafeEmptyLoadPlanner(), no_dist=True)
    extra = path / _METADATA_FILENAME
    if extra.is_file():
        checkpoint.update(load_file(extra))
    return checkpoint


class _MetadataUnpickler(pickle.Unpickler):
    """Builds a `.metadata` of torch.distributed.checkpoint and nothing else: its dataclasses and enums, torch's
    dtypes, layouts and sizes, and paths."""

    def __init__(self, file, where: Path) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        # By name first: the base class imports `module` to find `name`, and importing a module runs it (a folder
        # that plants `planted/__init__.py` beside its `.metadata` would run it wherever the folder is importable).
        if module not in _ALLOWED_MODULES or "." in name:
            raise _refusal(self.where, f"{module}.{name}")
        found = super().find_class(module, name)
        if module in _METADATA_MODULES and isinstance(found, type) and found.__module__ == module:
            return found
        if module == "torch" and (found is torch.Size or isinstance(found, (torch.dtype, torch.layout,
                                                                             torch.memory_format))):
            return found
        if (module, name) == ("torch.serialization", "_get_layout"):  # a layout by name, from torch's own table
            return found
        if module == "pathlib" and isinstance(found, type) and issubclass(found, pathlib.PurePath):
            return found
        raise _refusal(self.where, f"{module}.{name}")


class SafeReader(FileSystemReader):
    """torch.distributed.checkpoint's file reader, with `.metadata` read by `_MetadataUnpickler` (what
    `FileSystemReader.read_metadata` does, with that unpickler in place of `pickle.load`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            metadata = _MetadataUnpickler(file, Path(str(self.path))).load()
        if not isinstance(metadata, Metadata):
            raise _refusal(path, f"a {type(metadata).__name__} where a checkpoint's Metadata belongs")
        _check_storage(metadata, Path(str(self.path)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_storage(metadata: Metadata, folder: Path) -> None:
    """Every entry of `.metadata` reads bytes of a regular file directly in the folder, listed in its SHA256SUMS,
    within that file's size. torch joins an entry's path to the folder as written: an absolute path or `../` read
    outside it (a file beside it, a FIFO that blocks forever, `/dev/zero` for as long as the entry says)."""
    sums = read_sums(folder)
    sizes: dict[str, int] = {}
    for index, item in (metadata.storage_data or {}).items():
        name = str(getattr(item, "relative_path", ""))
        where = f"{folder}: refused to load: its .metadata reads the entry {index.fqn!r} from {name!r}"
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise UnsafeCheckpoint(f"{where}, which is not a file of the folder; a save names only its own files")
        if name not in sizes:
            file = folder / name
            if file.is_symlink() or not file.is_file():
                raise UnsafeCheckpoint(f"{where}, which is not a regular file in the folder")
            if sums is not None and name not in sums:
                raise UnsafeCheckpoint(f"{where}, which its {SUMS} does not list")
            sizes[name] = file.stat().st_size
        offset, length = int(getattr(item, "offset", 0)), int(getattr(item, "length", 0))
        if offset < 0 or length < 0 or offset + length > sizes[name]:
            raise UnsafeCheckpoint(f"{where} at bytes {offset}..{offset + length}, beyond its {sizes[name]} bytes: "
                                   "the folder is damaged or was not written by a save")


def _load_bytes(planner: DefaultLoadPlanner, read_item: Any, value: Any) -> None:
    """`DefaultLoadPlanner.load_bytes` made safe: the entry is loaded by `load_file` (weights_only=True and the
    allow-list), where the default planner's load_bytes would unpickle anything."""
    loaded = load_file(value, where=f"the sharded checkpoint's entry {read_item.dest_index.fqn!r}")
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch.distributed.checkpoint's load planner, with non-tensor entries loaded without running code."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        _load_bytes(self, read_item, value)


class SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    """The planner that reads a whole sharded checkpoint into an empty state dict (to consolidate it), made safe."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        _load_bytes(self, read_item, value)

"""sha256 digests that let a load tell a damaged checkpoint from a good one, and name what is damaged.

A checkpoint file (`torch.save`'s zip archive) is not checked by torch when it loads: 8 KB overwritten inside its
tensor data loaded without complaint, and a resumed run trained on values up to 1e29. So:

- a single-file checkpoint records, inside itself, the sha256 of every tensor it holds and of everything else it
  holds (`content_digests`, under `KEY`): written in the same file, it is replaced atomically with it, and a load
  recomputes and compares them (`verify_content`), naming the file and the first entries that differ;
- a folder (a sharded checkpoint, an export) holds `SHA256SUMS`, one line per file as `sha256sum` writes it (so
  `sha256sum -c SHA256SUMS` checks it by hand too), written inside the folder before the folder is moved into place
  (`write_sums`, `verify_sums`).

Hashing runs on several threads (hashlib releases the GIL on large buffers): see docs/failures.md for what it adds to a
save at the 1.5B shape.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

KEY = "lightning_logra_sha256"  # where a single-file checkpoint keeps its digests
SUMS = "SHA256SUMS"  # the digests of a folder's files, in sha256sum's format
HASH_THREADS = min(8, os.cpu_count() or 1)
_BLOCK = 1 << 24  # bytes read at a time when hashing a file


class DamagedCheckpoint(ValueError):
    """A checkpoint (or export) whose bytes differ from those recorded when it was written."""


def _tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (a GPU tensor is copied to the CPU for it)."""
    data = tensor.detach().reshape(-1).contiguous().cpu()  # (numel,)
    digest = hashlib.sha256(f"{data.dtype}{tuple(tensor.shape)}".encode())
    digest.update(data.view(torch.uint8).numpy())  # the raw bytes, whatever the dtype (bf16 has no numpy type)
    return digest.hexdigest()


def tensor_leaves(value: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside `value` (dicts, lists and tuples, nested), with a path that names it."""
    if torch.is_tensor(value):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from tensor_leaves(item, f"{path}/{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from tensor_leaves(item, f"{path}/{index}")


def _skeleton(value: Any) -> Any:
    """`value` with its tensors left out, as JSON that is the same before a save and after the load: what the
    tensor digests do not cover (steps, settings, hyper-parameters, loop state)."""
    if torch.is_tensor(value):
        return "<tensor>"
    if isinstance(value, dict):
        return [[repr(key), _skeleton(item)] for key, item in value.items()]
    if isinstance(value, (list, tuple)):
        return [_skeleton(item) for item in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    text = repr(value)
    # An object without a repr of its own shows its address, which differs after a load: its type must do.
    return f"<{type(value).__module__}.{type(value).__qualname__}>" if " at 0x" in text else text


def content_digests(checkpoint: dict[str, Any]) -> dict[str, str]:
    """{tensor path: sha256} for every tensor of `checkpoint`, plus "(the rest)": the sha256 of everything else."""
    leaves = list(tensor_leaves(checkpoint))
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        digests = dict(zip((path for path, _ in leaves), pool.map(_tensor_digest, (t for _, t in leaves))))
    rest = json.dumps(_skeleton(checkpoint), allow_nan=True).encode()
    digests["(the rest)"] = hashlib.sha256(rest).hexdigest()
    return digests


def verify_content(checkpoint: dict[str, Any], recorded: dict[str, str], where: str) -> None:
    """Raise `DamagedCheckpoint` naming `where` and what differs if `checkpoint` is not what `recorded` says."""
    found = content_digests(checkpoint)
    damaged = sorted(key for key in found.keys() | recorded.keys() if found.get(key) != recorded.get(key))
    if damaged:
        shown = ", ".join(damaged[:5]) + (f" and {len(damaged) - 5} more" if len(damaged) > 5 else "")
        raise DamagedCheckpoint(f"{where} is damaged: {shown} differ from what was written (sha256); it was "
                                f"corrupted after the save (disk, copy, transfer). Use another checkpoint (an "
                                f"earlier one, or a copy of this one)")


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def folder_files(folder: Path) -> list[str]:
    """The names of the files directly in `folder` (sorted), but its SHA256SUMS. A folder inside it (an export's
    `step-NNNNNN`) is a folder of its own, with its own SHA256SUMS."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != SUMS)


def digests_of(folder: Path, names: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        return dict(zip(names, pool.map(lambda name: file_digest(folder / name), names)))


def write_sums(folder: Path, digests: dict[str, str] | None = None) -> None:
    """`folder`/SHA256SUMS, one `<sha256>  <file>` line per file, as `sha256sum` writes it: of `digests`, or of
    every file in the folder."""
    if digests is None:
        digests = digests_of(folder, folder_files(folder))
    lines = "".join(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))
    with open(folder / SUMS, "w") as f:
        f.write(lines)
        f.flush()
        os.fsync(f.fileno())


def read_sums(folder: Path) -> dict[str, str] | None:
    """{file: sha256} from `folder`/SHA256SUMS; None if the folder has none (written before folders had one)."""
    path = folder / SUMS
    if not path.is_file():
        return None
    sums = {}
    for line in path.read_text().splitlines():
        digest, _, name = line.partition(" ")
        sums[name[1:]] = digest  # "<sha256>  <name>", or "<sha256> *<name>" as `sha256sum --binary` writes
    return sums


def verify_sums(folder: Path, names: list[str] | None = None) -> None:
    """Check the files of `folder` (or the given ones among them) against its SHA256SUMS; a file missing, added
    or changed raises `DamagedCheckpoint` naming it. A folder without SHA256SUMS is loaded unchecked, with a warning
    (refusing it would refuse every checkpoint written before folders had one)."""
    sums = read_sums(folder)
    if sums is None:
        log.warning("%s has no %s: nothing vouches for its files (it was written before folders had one, or by "
                    "something else), and they are loaded without a check for damage", folder, SUMS)
        return
    present = folder_files(folder)
    missing = sorted(set(sums) - set(present))
    extra = sorted(set(present) - set(sums))
    checked = sorted(set(sums) & set(present) & set(present if names is None else names))
    changed = [name for name, digest in digests_of(folder, checked).items() if digest != sums[name]]
    problems = [f"{name} (changed)" for name in changed] + [f"{name} (missing)" for name in missing]
    problems += [f"{name} (not written with it)" for name in extra]
    if problems:
        raise DamagedCheckpoint(f"{folder} is damaged: {', '.join(problems)} (against its {SUMS}; "
                                f"`sha256sum -c {SUMS}` in the folder shows the same). Use another copy")

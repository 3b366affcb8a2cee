"""Named tensors as safetensors bytes, for full loads and for the blocks an engine's workers answer with, made and read
with as few copies as the format allows.

safetensors' own `save` copies a GPU tensor to pageable host memory one tensor at a time, waiting on each, and then
again into the bytes it returns; its `load` copies every tensor out of the bytes it is given, and an engine server
reads one full load three times (the route's check, every worker's check, the load). Here the sender queues every
tensor's copy into one buffer (pinned on a GPU, so the copies run at the link's rate) before one wait, and the
receiver's tensors are views of the bytes received, after a check of the header that keeps every view inside them:
the format's dtypes and header, each tensor's bytes its shape's, the data covered in order without gaps or overlaps.
The bytes are the format's own: any safetensors reader reads them, and these read any safetensors writer's.
"""

from __future__ import annotations

import json
import struct
import warnings

import torch

_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_MAX_HEADER = 100_000_000  # the format's own bound on the header's length, in bytes

# Views of received bytes are read (checked, copied into the engine's weights), never written: torch's warning that
# a view of immutable bytes could be written says nothing here.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def pack_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """Named tensors (any devices, contiguous or not) as safetensors bytes. Ordered by element size, largest first,
    so that every tensor's bytes start aligned for its dtype (the data starts 8-aligned)."""
    order = sorted(tensors, key=lambda name: -tensors[name].element_size())
    header, offset = {}, 0
    for name in order:
        tensor = tensors[name]
        if tensor.dtype not in _CODES:
            raise TypeError(f"{name!r}: {tensor.dtype} has no safetensors code here; known: {sorted(_CODES.values())}")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads its header with spaces
    start = 8 + len(encoded)
    devices = {t.device for t in tensors.values() if t.is_cuda}
    buffer = torch.empty(start + offset, dtype=torch.uint8, pin_memory=bool(devices))  # (total,) bytes
    buffer[:start] = torch.frombuffer(bytearray(struct.pack("<Q", len(encoded)) + encoded), dtype=torch.uint8)
    for name in order:
        tensor, (begin, end) = tensors[name].detach(), header[name]["data_offsets"]
        if end > begin:  # device to pinned host memory runs asynchronously: every copy is queued before one wait
            buffer[start + begin : start + end].view(tensor.dtype).view(tensor.shape).copy_(tensor, non_blocking=True)
    for device in devices:
        torch.cuda.synchronize(device)
    return buffer.numpy().tobytes()


def unpack_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """The named tensors of safetensors bytes, as read-only views of `data` on the CPU (nothing copied: copy what
    is kept after `data` goes, or written to). ValueError naming what is wrong when the bytes are not the format's."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes: too short for a safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    if length > min(_MAX_HEADER, len(data) - 8):
        raise ValueError(f"header of {length} bytes in {len(data)} bytes")
    try:
        header = json.loads(bytes(data[8 : 8 + length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"the header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    start, size = 8 + length, len(data) - 8 - length
    spans = sorted((_span(name, entry), name) for name, entry in header.items())
    covered = 0
    for (begin, end), name in spans:
        if begin != covered:
            raise ValueError(f"{name!r} starts at byte {begin} of the data, not at {covered}: the data must be "
                             "covered in order, without gaps or overlaps")
        covered = end
    if covered != size:
        raise ValueError(f"the tensors cover {covered} of the data's {size} bytes")
    return {name: _view(data, start, header[name]) for _, name in spans}


def _span(name: str, entry: object) -> tuple[int, int]:
    """A header entry's data offsets, checked against its dtype and shape."""
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
        raise ValueError(f"{name!r}: not a tensor entry of a known dtype ({sorted(_DTYPES)})")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"{name!r}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"{name!r}: data_offsets {offsets!r} are not a span [begin, end]")
    numel = 1
    for n in shape:
        numel *= n
    expected = numel * _DTYPES[entry["dtype"]].itemsize
    if offsets[1] - offsets[0] != expected:
        raise ValueError(f"{name!r}: {offsets[1] - offsets[0]} bytes for {entry['dtype']} of shape {shape} "
                         f"({expected} bytes)")
    return offsets[0], offsets[1]


def _view(data: bytes, start: int, entry: dict) -> torch.Tensor:
    dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
    begin, end = entry["data_offsets"]
    if end == begin:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses a count of 0
    tensor = torch.frombuffer(data, dtype=dtype, offset=start + begin, count=(end - begin) // dtype.itemsize)
    if tensor.data_ptr() % dtype.itemsize:
        tensor = tensor.clone()  # another writer's unaligned tensor: copied to aligned memory
    return tensor.view(shape)

"""Named tensors as safetensors bytes (rollout/tensor_bytes.py): exact both ways, read by safetensors and reading it,
the receiver's tensors views of the bytes, every view aligned, and a header that would read outside the bytes
refused."""

import json
import struct

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from lightning_logra.rollout.tensor_bytes import pack_tensors, unpack_tensors


def _tensors(device="cpu") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "odd.bf16": torch.randn(3, generator=generator).to(torch.bfloat16),  # 6 bytes: an fp32 after it, unaligned
        "w.fp32": torch.randn(5, 7, generator=generator),
        "t.fp32": torch.randn(7, 5, generator=generator).t(),  # not contiguous
        "h.fp16": torch.randn(2, 3, generator=generator).half(),
        "d.fp64": torch.randn(3, generator=generator, dtype=torch.float64),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "ids.i64": torch.arange(5),
        "mask": torch.tensor([True, False, True]),
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].cpu(), tensor.cpu()), name


def test_round_trip_is_exact_and_the_bytes_are_the_formats_both_ways():
    tensors = _tensors()
    data = pack_tensors(tensors)
    _assert_same(unpack_tensors(data), tensors)
    _assert_same(safetensors_load(data), tensors)  # any safetensors reader reads them
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    _assert_same(unpack_tensors(safetensors_save(contiguous, metadata={"by": "another writer"})), tensors)


def test_the_receivers_tensors_are_aligned_views_of_the_bytes_received():
    data = pack_tensors(_tensors())
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    for name, tensor in unpack_tensors(data).items():
        if tensor.numel():
            assert base <= tensor.data_ptr() < base + len(data), f"{name} was copied"
            assert tensor.data_ptr() % tensor.element_size() == 0, f"{name} is not aligned for {tensor.dtype}"


def test_another_writers_unaligned_tensor_is_read_right():
    header = json.dumps({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}).encode()
    body = bytes([7]) + torch.tensor([1.5, -2.0]).numpy().tobytes()
    tensors = unpack_tensors(struct.pack("<Q", len(header)) + header + body)
    assert tensors["a"].tolist() == [7] and tensors["b"].tolist() == [1.5, -2.0]


def _with_header(header: object, data_bytes: int = 8) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + bytes(data_bytes)


@pytest.mark.parametrize("data, problem", [
    (b"\x01\x02", "too short"),
    (struct.pack("<Q", 2**40) + b"{}", "header of 1099511627776 bytes"),
    (struct.pack("<Q", 4) + b"{no}", "not JSON"),
    (_with_header([1, 2]), "not a JSON object"),
    (_with_header({"w": {"dtype": "F128", "shape": [2], "data_offsets": [0, 8]}}), "known dtype"),
    (_with_header({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}), "not a list of sizes"),
    (_with_header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}), "not a span"),
    (_with_header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}), "8 bytes for F32 of shape [4]"),
    (_with_header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}), "starts at byte 4"),  # a gap
    (_with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}), "starts at byte 4"),  # overlap
    (_with_header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}), "cover 16 of the data's 8"),
    (_with_header({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}), "cover 4 of the data's 8"),
    (_with_header({"w": {"dtype": "F64", "shape": [2**40], "data_offsets": [0, 2**43]}}), "cover 8796093022208"),
])
def test_a_header_that_would_read_outside_the_bytes_or_misread_them_is_refused(data, problem):
    with pytest.raises(ValueError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        unpack_tensors(data)


def test_a_dtype_the_format_lacks_is_named():
    with pytest.raises(TypeError, match="complex64"):
        pack_tensors({"z": torch.zeros(2, dtype=torch.complex64)})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned buffer and queued device copies are CUDA's")
def test_gpu_tensors_are_packed_exactly_through_one_pinned_buffer():
    tensors = {name: tensor.cuda() for name, tensor in _tensors().items()}
    _assert_same(unpack_tensors(pack_tensors(tensors)), tensors)

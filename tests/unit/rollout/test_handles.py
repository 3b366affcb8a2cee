"""Full loads by reference (`rollout/handles.py`): which path a load takes, and tensors handed to another process
as handles that it opens without a copy of the numbers travelling: shared memory on this CPU machine, the mechanism
CUDA IPC takes on a GPU (which no test here can run)."""

import multiprocessing
import pickle

import pytest
import torch

from lightning_logra.rollout.handles import choose_full_load, device_id, open_tensors, share_tensors

GPU, OTHER_GPU = "cuda:GPU-0a", "cuda:GPU-1b"  # device_id's form for two physical GPUs


def test_auto_shares_only_with_one_worker_on_the_trainers_gpu_in_another_process():
    assert choose_full_load("auto", [GPU], {GPU}) == "shared"  # colocated: CUDA IPC
    assert choose_full_load("auto", ["cpu"], {"cpu"}) == "bytes"  # the CPU backend keeps the bytes path
    assert choose_full_load("auto", [GPU], {OTHER_GPU}) == "bytes"  # the engine on another GPU
    assert choose_full_load("auto", [GPU], {GPU, "cpu"}) == "bytes"  # some tensors on the host
    assert choose_full_load("auto", [GPU], {"cpu"}) == "bytes"
    assert choose_full_load("auto", [GPU, OTHER_GPU], {GPU}) == "bytes"  # tensor parallel: shards on other GPUs
    assert choose_full_load("auto", [GPU], {GPU}, separate_process=False) == "bytes"  # IPC cannot reopen its own
    assert choose_full_load("bytes", [GPU], {GPU}) == "bytes"


def test_shared_is_refused_where_no_worker_can_open_the_tensors():
    assert choose_full_load("shared", ["cpu"], {"cpu"}) == "shared"  # shared memory
    assert choose_full_load("shared", [GPU], {"cpu", GPU}) == "shared"
    assert choose_full_load("shared", [GPU], {"cpu"}, separate_process=False) == "shared"
    for workers, tensors, separate in (([GPU], {OTHER_GPU}, True), (["cpu"], {GPU}, True),
                                       ([GPU, OTHER_GPU], {GPU}, True), ([GPU], {GPU}, False)):
        with pytest.raises(ValueError, match="engine.full_load: shared needs one engine worker that can open"):
            choose_full_load("shared", workers, tensors, separate)
    with pytest.raises(ValueError, match="engine.full_load must be one of auto, bytes, shared, got 'ipc'"):
        choose_full_load("ipc", [GPU], {GPU})
    assert device_id("cpu") == device_id(torch.zeros(1).device) == "cpu"


def _open_and_answer(data: bytes, answer) -> None:
    tensors = open_tensors(data, torch.device("cpu"))
    answer.send_bytes(pickle.dumps({name: (t.is_shared(), t.clone()) for name, t in tensors.items()}))


def test_tensors_reach_another_process_as_handles():
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(512, 1024, generator=generator))  # 2 MiB of numbers
    tensors = {"w": weight, "w_t": weight.detach().t(),  # not contiguous: sent as a contiguous copy
               "b": torch.randn(7, generator=generator).to(torch.bfloat16)}
    data, kept = share_tensors(tensors)
    assert len(data) < 2048  # the handles, not the numbers
    assert not weight.is_shared()  # the trainer's parameter stays where it was; a copy went to shared memory
    context = multiprocessing.get_context("spawn")  # as vLLM starts its engine's processes
    ours, theirs = context.Pipe()
    worker = context.Process(target=_open_and_answer, args=(data, theirs))
    worker.start()
    answer = pickle.loads(ours.recv_bytes())
    worker.join(60)
    assert worker.exitcode == 0
    assert list(answer) == list(tensors)
    for name, tensor in tensors.items():
        shared, value = answer[name]
        assert shared  # opened in place, not unpickled copies
        assert value.dtype == tensor.dtype and torch.equal(value, tensor.detach()), name
    del kept

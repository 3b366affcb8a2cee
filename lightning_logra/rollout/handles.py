"""Full weights handed to the engine's worker by reference instead of by value: per tensor a CUDA IPC handle (a GPU
tensor) or a shared-memory segment (a CPU tensor), a few hundred bytes whatever the tensor's size.

The bytes path (`tensor_bytes.pack_tensors`) serializes every number into a message, which vLLM's `collective_rpc` then
carries to the worker's process: for a 7B model 15 GB through host memory at every full load. When the engine runs
on the GPU the trainer's weights are on, the worker can instead open the trainer's own GPU memory (CUDA IPC, as
vLLM's RLHF colocation example does) and copy from it into its weights: nothing leaves the GPU and nothing is
serialized. torch's multiprocessing reductions make the handles (`reduce_tensor`); on the CPU the same call moves a
tensor into shared memory, which is how the path is tested without a GPU.

A message is the pickle of [(name, rebuild function, its arguments)], made with the pickler torch registers its
storage reductions with. It goes from the trainer to its own engine's workers only, as bytes through
`collective_rpc`. The tensors it refers to must stay alive and unchanged until the worker has copied them: the
sender keeps them, and the worker synchronizes its device before it returns.
"""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401 (registers torch's tensor and storage reductions with ForkingPickler)
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

_CUDA_DEVICE_ARG = 6  # the position of the device index among rebuild_cuda_tensor's arguments

# full_load settings: "bytes" always serializes; "shared" always hands over by reference; "auto" hands over by
# reference when the engine's one worker runs on the GPU every tensor is on, and serializes otherwise.
FULL_LOADS = ("auto", "bytes", "shared")


def device_id(device: torch.device | str) -> str:
    """"cpu", or "cuda:<uuid>": the physical GPU, comparable across processes that number their GPUs differently."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_properties(device).uuid}"
    return device.type  # another accelerator: no handles for it here


def choose_full_load(setting: str, worker_devices: list[str], tensor_devices: set[str],
                     separate_process: bool = True) -> str:
    """"bytes" or "shared" for a full load of tensors on `tensor_devices` into an engine whose workers run on
    `worker_devices` (all `device_id`s), in a process of their own or (not `separate_process`) in this one.

    Handles need one worker (tensor-parallel shards sit on other GPUs) that can open every tensor: one on its own
    GPU, or one in shared memory on the host. A CUDA IPC handle cannot be opened by the process that made it, so an
    engine inside the trainer's process takes CPU tensors only."""
    if setting not in FULL_LOADS:
        raise ValueError(f"engine.full_load must be one of {', '.join(FULL_LOADS)}, got {setting!r}")
    if setting == "bytes":
        return "bytes"
    gpu = worker_devices[0] if len(worker_devices) == 1 and worker_devices[0].startswith("cuda:") else None
    if setting == "auto":
        return "shared" if gpu is not None and separate_process and tensor_devices == {gpu} else "bytes"
    openable = {"cpu"} if gpu is None or not separate_process else {"cpu", gpu}
    if len(worker_devices) != 1 or not tensor_devices <= openable:
        raise ValueError(
            f"engine.full_load: shared needs one engine worker that can open every tensor (CUDA IPC on its own GPU "
            f"from another process, or shared memory on the host); the workers run on {worker_devices} "
            f"({'another' if separate_process else 'this'} process) and the tensors are on "
            f"{sorted(tensor_devices)}: use full_load auto or bytes")
    return "shared"


def share_tensors(tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    """A message that refers to `tensors`, and the tensors it refers to: keep those until the receiver has copied.

    A CPU tensor not yet in shared memory is copied there (a parameter of the trainer is left where it is); a
    CUDA tensor is referred to where it lies (after making it contiguous, a copy only if it was not)."""
    kept, items = [], []
    for name, tensor in tensors.items():
        tensor = tensor.detach().contiguous()
        if tensor.device.type == "cpu" and not tensor.is_shared():
            tensor = tensor.clone().share_memory_()
        kept.append(tensor)
        rebuild, args = reduce_tensor(tensor)
        items.append((name, rebuild, args))
    if any(t.is_cuda for t in kept):
        torch.cuda.synchronize()  # the receiver reads them from another process, outside this one's streams
    return bytes(ForkingPickler.dumps(items)), kept


def open_tensors(data: bytes, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors a `share_tensors` message refers to, opened in this process (no copy). GPU tensors are opened
    on `device`, this process's index of the GPU they are on (the sender may number its GPUs differently)."""
    out = {}
    for name, rebuild, args in pickle.loads(data):
        if rebuild is rebuild_cuda_tensor:
            args = list(args)
            args[_CUDA_DEVICE_ARG] = device.index if device.index is not None else torch.cuda.current_device()
        out[name] = rebuild(*args)
    return out

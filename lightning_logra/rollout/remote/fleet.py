"""The engine servers of a run: given by URL or launched here, found up or down, a call's prompts split over them, and
each brought to the trainer's weight version before it is used.

A server that refuses connections, fails a request or does not answer within the connection's deadline is marked
down, and asked again every `probe_every_s`; with none up, a call waits `no_server_wait_s` for one, then raises
`NoServerLeft` naming the URLs. A server found behind (restarted, stopped for a while, joining mid-run) is caught up by
replaying the journal's updates since the version it holds, or by a full load when that moves fewer bytes (the choice
is logged with both sizes). Versions past the one this process resumed from that another process of the run made
(two trainers resumed from one checkpoint) are not this process's: such a server is loaded in full.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from lightning_logra.base.stop import STOP
from lightning_logra.base.waits import waiting_for
from lightning_logra.rollout.journal import UpdateJournal
from lightning_logra.rollout.protocol import PARENT_ENV, TOKEN_ENV, Label, model_differences
from lightning_logra.rollout.remote.client import Connection, Server, ServerFailed

log = logging.getLogger(__name__)

_WATCH_S = 0.5  # how often a call under way looks at the run's stop signal


class NoServerLeft(RuntimeError):
    """No engine server answered: the run cannot generate."""


class Fleet:
    """The servers, and what keeps them in step with `journal` (the trainer's run id, version and updates).

    `full_load(server, replaying)` loads every tensor of the trainer's into `server` alone (`replaying`: what a
    replay would have moved instead, for the log); ServerFailed when it cannot."""

    def __init__(self, urls: list[str], launch: int, serve_args: list[str], connection: Connection,
                 journal: UpdateJournal, full_load: Callable[[Server, str], None], probe_every_s: float,
                 no_server_wait_s: float, start_timeout_s: float) -> None:
        self.connection = connection
        self.servers = [Server(url.rstrip("/"), connection) for url in urls]
        self.launch, self.serve_args = launch, serve_args
        self.journal = journal
        self.full_bytes = 0  # the bytes of a full load (the model's files until one was made)
        self.inherited = 0  # the version this process resumed from: up to it, any process of the run made the same
        self.probe_every_s, self.no_server_wait_s, self.start_timeout_s = (probe_every_s, no_server_wait_s,
                                                                           start_timeout_s)
        self._full_load = full_load
        self.model: dict = {}  # the trainer's model (`protocol.model_summary`): a server of another is not used
        self.log_dir: str | None = None  # where launched servers write their logs (None: the system's temp folder)
        self._started = False
        # Updates, loads and catch-ups, one at a time: in flight, updates are sent from a thread of their own while
        # generation (which catches servers up before it asks them) runs on another.
        self.changing = threading.RLock()

    # ---- launch and readiness -------------------------------------------------------------------------------------

    def start(self, model: str) -> None:
        """Launch the servers (`launch`), then wait up to `start_timeout_s` for all of them to answer; go on with
        those that do. NoServerLeft if none does."""
        if self.launch:
            self._launch(model)
        deadline = time.monotonic() + self.start_timeout_s
        with waiting_for(f"engine servers {', '.join(s.url for s in self.servers)}", log):
            while True:
                for server in self.servers:
                    if not server.up:
                        self.probe(server, force=True)
                if all(s.up for s in self.servers) or time.monotonic() > deadline:
                    break
                self._check_launched()
                time.sleep(1.0)
        if not any(s.up for s in self.servers):
            self.close()
            raise NoServerLeft(f"model.rollouts.engine: no engine server answered within engine.start_timeout_s="
                               f"{self.start_timeout_s} s: {', '.join(s.url for s in self.servers)}")
        for server in self.servers:
            if not server.up:
                log.warning("engine server %s does not answer; going on without it (asked again every %.0f s)",
                            server.url, self.probe_every_s)
        self._started = True

    def _launch(self, model: str) -> None:
        env = {**os.environ, TOKEN_ENV: self.connection.token, PARENT_ENV: str(os.getpid())}
        for _ in range(self.launch):
            port = _free_port()
            path = Path(self.log_dir or tempfile.gettempdir()) / f"engine-server-{port}.log"
            path.parent.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", "lightning_logra.rollout.server", "--model", model,
                       "--port", str(port), *self.serve_args]
            with open(path, "ab") as out:  # appended: a resumed run in the same folder keeps the earlier logs
                process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True, preexec_fn=_die_with_parent)
            self.servers.append(Server(f"http://127.0.0.1:{port}", self.connection, process=process,
                                       log_path=str(path)))
            log.info("launched an engine server on port %d (its log: %s)", port, path)

    def _check_launched(self) -> None:
        for server in self.servers:
            if server.process is not None and server.process.poll() is not None:
                tail = Path(server.log_path).read_text(errors="replace")[-3000:] if server.log_path else ""
                self.close()
                raise RuntimeError(f"the engine server this run launched on {server.url} exited with "
                                   f"{server.process.returncode}; the end of its log:\n{tail}")

    def close(self) -> None:
        """Stop the servers launched here (and forget them)."""
        self._started = False
        for server in self.servers:
            if server.process is not None and server.process.poll() is None:
                try:
                    os.killpg(server.process.pid, signal.SIGTERM)
                    server.process.wait(timeout=30)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(server.process.pid, signal.SIGKILL)
        if self.launch:
            self.servers = []

    def probe(self, server: Server, force: bool = False) -> None:
        """Ask a server for its state (a server down: only when due, unless `force`); up if it answers."""
        if not force and time.monotonic() < server.next_probe:
            return
        try:
            server.state()
        except ServerFailed as err:
            server.next_probe = time.monotonic() + self.probe_every_s
            log.debug("engine server %s: %s", server.url, err)
            return
        differences = model_differences(self.model, server.model)
        if differences:  # its tensors are not the trainer's: no load or update could make them so
            why = (f"engine server {server.url} serves {server.model.get('name')}, whose tensors differ from those "
                   f"of the trainer's model {self.model.get('name')}: {'; '.join(differences)}; start it with the "
                   "trainer's model (`lightning-logra serve --model ...`)")
            if not self._started:
                self.close()
                raise ValueError(f"model.rollouts.engine: {why}")
            log.warning("%s; not used, asked again every %.0f s", why, self.probe_every_s)
            server.up, server.next_probe = False, time.monotonic() + self.probe_every_s
            return
        if not server.up:
            log.warning("engine server %s answers (weights: run %s, version %s; %s, %s)", server.url, server.run,
                        server.version, server.model.get("name"), server.model.get("dtype"))
        server.up = True

    def down(self, server: Server, why: object) -> None:
        if server.up:
            log.warning("engine server %s is given up on for now (%s); asked again every %.0f s", server.url, why,
                        self.probe_every_s)
        server.up, server.next_probe = False, time.monotonic() + self.probe_every_s

    def ready(self, catch_up: bool) -> list[Server]:
        """The servers to use: up (those down are asked again when due) and, with `catch_up` (the rank that sends),
        at the trainer's version (caught up first). With none, every server is asked again each `probe_every_s` for
        `no_server_wait_s`; then NoServerLeft."""
        deadline = time.monotonic() + self.no_server_wait_s
        while True:
            for server in self.servers:
                if not server.up:
                    self.probe(server)
            if catch_up:
                with self.changing:
                    for server in [s for s in self.servers if s.up and not self.current(s)]:
                        try:
                            self.catch_up(server, full_load=True)
                        except ServerFailed as err:
                            self.down(server, err)
            ready = [s for s in self.servers if s.up]
            if ready:
                return ready
            if time.monotonic() >= deadline:
                raise NoServerLeft(f"model.rollouts.engine: no engine server is left to generate on: "
                                   f"{', '.join(s.url for s in self.servers)} (none answered for "
                                   f"engine.no_server_wait_s={self.no_server_wait_s} s; start them again, then "
                                   "resume the run from its last checkpoint with --ckpt_path)")
            if STOP.overdue():
                raise STOP.error("waiting for an engine server")
            time.sleep(min(self.probe_every_s, max(deadline - time.monotonic(), 0.0)))

    def parallel(self, calls: dict[Server, Callable[[], object]]) -> dict[Server, object]:
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

    def current(self, server: Server) -> bool:
        """Whether a server's weights are the trainer's version, as far as its label tells."""
        if server.suspect:
            return False
        journal = self.journal
        return server.run in (None, journal.run) and server.version == journal.version and (
            server.run is not None or journal.version == 0) and self._of_this_process(server)

    def _of_this_process(self, server: Server) -> bool:
        """Whether a server's version is this process's version of that number: made by it (or by a trainer that
        does not say which process it is), or one it resumed with (its checkpoint's history, the same whichever
        process made it). Past that, another process of the run (resumed from the same checkpoint) made other
        weights under the same numbers."""
        return server.holder in (None, self.connection.tag) or (
            server.version is not None and server.version <= self.inherited)

    def catch_up(self, server: Server, full_load: bool) -> None:
        """Bring a server to the trainer's version: replay the journal's updates since the version it holds, or (when
        that is impossible or moves more bytes, and `full_load`) load every tensor."""
        journal = self.journal
        same_run = server.run == journal.run or (server.run is None and server.version == 0)
        known = same_run and server.version is not None and not server.suspect and self._of_this_process(server)
        updates = journal.since(server.version) if known else None
        replay = sum(len(u) for u in updates) if updates is not None else math.inf
        if replay <= self.full_bytes or (updates is not None and not full_load):
            log.warning("engine server %s holds version %s of %s, the trainer %d: replaying %d updates (%d bytes; a "
                        "full load: %d bytes)", server.url, server.version, server.run, journal.version,
                        len(updates), replay, self.full_bytes)
            for version, data in enumerate(updates, start=server.version + 1):
                server.update(data, Label(journal.run, version))
            return
        if not full_load:
            return
        self._full_load(server, "impossible" if updates is None else f"{replay} bytes")
        server.suspect = not server.up  # whole now, unless the load failed (then it is down and still suspect)


def split(indices: list[int], servers: list[Server]) -> dict[Server, list[int]]:
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

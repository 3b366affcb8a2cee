"""One engine server as the trainer sees it: where it is, what its weights are as it last said, the fleet's
bookkeeping of it (up or down, its speed, the process of a launched one), and the requests of the wire protocol
(`rollout/protocol.py`) to it."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from dataclasses import dataclass, field

from lightning_logra.base.http import request_within
from lightning_logra.rollout.protocol import (
    PREFIX,
    PROCESS_HEADER,
    SHA_HEADER,
    TOKEN_ENV,
    BlocksAsk,
    GenerateAnswer,
    GenerateAsk,
    Label,
    new_process,
    process_tag,
    sha256,
)


class ServerFailed(RuntimeError):
    """One server failed a request (refused, timed out, answered an error)."""


class Behind(Exception):
    """A server holds another version than the request needs (HTTP 409)."""

    def __init__(self, label: Label) -> None:
        super().__init__(f"holds version {label.version} of run {label.run}")


@dataclass
class Connection:
    """What every request of a run carries and waits: the servers' shared token, the deadlines, and this trainer
    process's identity (`protocol.new_process`; every rank of a trainer sends its rank 0's)."""

    token: str | None = None
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 600.0  # a server that has not answered after this long is given up on
    process: str = field(default_factory=new_process)

    @property
    def tag(self) -> str:
        """This process as the servers name it (`protocol.process_tag`)."""
        return process_tag(self.process)


@dataclass(eq=False)  # one per URL, told apart by identity (a dict key)
class Server:
    url: str
    connection: Connection = field(default_factory=Connection)
    up: bool = False
    run: str | None = None  # the label of its weights, as it last said
    version: int | None = None
    holder: str | None = None  # the tag of the trainer process that made them (`protocol.process_tag`), as it said
    max_model_len: int | None = None  # the longest prompt + completion it takes, as it said
    model: dict = field(default_factory=dict)  # the model it serves, as it said (`protocol.model_summary`)
    suspect: bool = False  # a load into it failed part-way: its label may not describe its weights (full load)
    tokens_per_s: float = 0.0  # completion tokens per second of its last answers (its share of a call)
    next_probe: float = 0.0  # when a server that is down is asked again
    process: subprocess.Popen | None = None  # a server the engine launched
    log_path: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # one weight change or read at a time per server

    def request(self, method: str, path: str, data: bytes = b"", params: dict | None = None,
                timeout: float | None = None, exclusive: bool = True):
        """One request (`exclusive`: none other but generations at once); ServerFailed when it cannot be had (the
        caller marks the server down); a refused token is a setting to fix, not a fault: PermissionError."""
        import requests

        connection = self.connection
        headers = {"Authorization": f"Bearer {connection.token}", SHA_HEADER: sha256(data),
                   PROCESS_HEADER: connection.process}
        try:
            with self.lock if exclusive else contextlib.nullcontext():
                answer = request_within(method, self.url + path, timeout or connection.request_timeout_s,
                                        connection.connect_timeout_s, data=data, params=params, headers=headers)
        except requests.RequestException as err:
            raise ServerFailed(f"{self.url}{path}: {err}") from err
        if answer.status_code == 409:
            return answer  # the server holds another version: the caller decides
        if answer.status_code == 423:
            held = answer.json()
            raise ServerFailed(f"{self.url} is in use by run {held.get('run')} (heard from {held.get('quiet_s')} s "
                               f"ago; trainer process {held.get('holder')}, this one is {connection.tag}): two "
                               "trainers on one server would each replace the other's weights, or, of one run (two "
                               "resumed from one checkpoint), take the other's for their own: give this trainer a "
                               "server of its own, or stop the other (a server is free once the trainer holding it "
                               "has ended, or been quiet for 2 minutes)")
        if answer.status_code == 401:
            raise PermissionError(f"engine server {self.url} refused this run's token: give the trainer the token "
                                  f"the server was started with (${TOKEN_ENV} or engine.token_file)")
        if answer.status_code != 200:
            raise ServerFailed(f"{self.url}{path}: HTTP {answer.status_code} {answer.text[:300]}")
        return answer

    def _relabel(self, answer: dict) -> Label:
        label = Label.from_json(answer)
        self.run, self.version, self.holder = label.run, label.version, answer.get("holder")
        return label

    def state(self) -> None:
        """Ask for its weights' label and its limit (within the connection's deadline)."""
        answer = self.request("GET", f"{PREFIX}/state", timeout=self.connection.connect_timeout_s).json()
        self._relabel(answer)
        self.max_model_len = answer.get("max_model_len")
        self.model = answer.get("model") or {}

    def update(self, data: bytes, label: Label, in_flight: bool = False) -> None:
        """Send an `Update`'s bytes; Behind when the server does not hold the version before `label`'s."""
        answer = self.request("POST", f"{PREFIX}/update", data, label.query(in_flight))
        held = self._relabel(answer.json())
        if answer.status_code == 409:
            raise Behind(held)

    def load(self, data: bytes, label: Label) -> None:
        """Send whole tensors (`tensor_bytes.pack_tensors`), which leave its weights at `label`."""
        self._relabel(self.request("POST", f"{PREFIX}/load", data, label.query()).json())

    def release(self, label: Label) -> None:
        """Say that this process, of the run of `label`, has ended: another may take the server at once."""
        self.request("POST", f"{PREFIX}/release", b"", label.query(), timeout=self.connection.connect_timeout_s)

    def blocks(self, ask: BlocksAsk) -> bytes:
        """The workers' blocks of the asked tensors (safetensors bytes); ServerFailed when it does not reach the
        version in time (left out now, caught up before it generates again)."""
        answer = self.request("POST", f"{PREFIX}/blocks", ask.to_bytes())
        if answer.status_code == 409:
            raise ServerFailed(f"{self.url} did not reach version {ask.min_version}: {answer.text}")
        return answer.content

    def generate(self, ask: GenerateAsk) -> list[list[dict]]:
        """Each prompt's samples (`GenerateAnswer.outputs`), timed for its share of later calls; Behind when it is
        not at the version in time (another rank's update has not reached it yet)."""
        start = time.perf_counter()
        answer = self.request("POST", f"{PREFIX}/generate", ask.to_bytes(), exclusive=False)
        if answer.status_code == 409:
            raise Behind(self._relabel(answer.json()))
        outputs = GenerateAnswer.from_json(answer.json()).outputs
        tokens = sum(len(sample["token_ids"]) for prompt in outputs for sample in prompt)
        self.tokens_per_s = tokens / max(time.perf_counter() - start, 1e-6)
        return outputs

"""The wire protocol between a trainer's `RemoteEngine` (`rollout/remote/`) and an engine server (`lightning-logra
serve`, `rollout/server/`): the shared token, the checksum header, the routes, and what each route is asked and
answers. Both sides import it; it imports neither (nor FastAPI, nor vLLM).

Every route lives under `/logra/`, needs `Authorization: Bearer <token>`, and carries the sha256 of its body in
`X-Logra-SHA256` and the trainer process's identity in `X-Logra-Process`. A server's weights are labelled with a run
and a weight version (the number of updates merged since the run's start), and held by the process that made them;
a route that needs another version than the server holds answers 409 with the server's label (run, version and the
holder's tag), and one of another process while a process holds the server 423 with the same and `quiet_s`.

- GET  /logra/state                          → {"run", "version", "max_model_len", "model"} (`model_summary`), once
                                               a change under way has ended (503 if not soon: ask again)
- POST /logra/update?run&version[&in_flight=1] `Update` bytes, merged on top of version - 1 → the label
- POST /logra/load?run&version                whole tensors (`tensor_bytes.pack_tensors`), which leave the weights
                                               at the label
- POST /logra/blocks                         a BlocksAsk → safetensors bytes keyed "name|row|col"
- POST /logra/generate                       a GenerateAsk → a GenerateAnswer
- POST /logra/release?run&version             the holding process has ended: the server is free
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import uuid
from dataclasses import dataclass, fields

from lightning_logra.base.settings import is_number

TOKEN_ENV = "LOGRA_SERVER_TOKEN"  # the shared token, on both sides (a server may read it from --token-file instead)
PARENT_ENV = "LOGRA_SERVE_PARENT_PID"  # the trainer that launched a server (RemoteEngine's launch): it dies with it
SHA_HEADER = "X-Logra-SHA256"
PROCESS_HEADER = "X-Logra-Process"  # the trainer process's identity (`new_process`), on every request
PREFIX = "/logra"
MAX_VERSION = 2**62  # a weight version past this is no count of updates
MAX_SAMPLES = 1024  # completions of one prompt one /generate may ask for (n)
MAX_SEED = 2**62 - 1  # a seed of a request: vLLM gives sample i of a prompt seed + i, which must stay an int64

log = logging.getLogger(__name__)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def new_process() -> str:
    """A trainer process's identity: random, its own even when another process resumes the same run from the same
    checkpoint (every rank of one trainer shares its rank 0's). Secret between the process and its servers: they
    name it by `process_tag` alone, so that another holder of the token cannot act as the process."""
    return uuid.uuid4().hex


def process_tag(process: str | None) -> str | None:
    """What a server says of a process: a digest of its identity, which tells processes apart but cannot act as one."""
    return None if process is None else sha256(process.encode())[:12]


def _whole(value, low: int, high: int) -> bool:
    return is_number(value, integer=True) and low <= value <= high


@dataclass(frozen=True)
class Label:
    """What a server's weights are: the trainer's run and weight version they equal (run None, version 0: the
    model's files, version 0 of any run that starts from them; version None: a change was cut short, unknown)."""

    run: str | None = None
    version: int | None = 0

    def to_json(self) -> dict:
        return {"run": self.run, "version": self.version}

    @classmethod
    def from_json(cls, data: dict) -> Label:
        return cls(data["run"], data["version"])

    def query(self, in_flight: bool | None = None) -> dict:
        """The query of /update (with `in_flight`) and /load."""
        return self.to_json() if in_flight is None else {**self.to_json(), "in_flight": int(in_flight)}

    @classmethod
    def from_query(cls, query) -> Label:
        """?run=<id>&version=<int>; ValueError naming the field when either is missing or malformed."""
        if not query.get("run"):
            raise ValueError("run: give ?run=<the run's id>")
        version = query.get("version", "")
        if not (version.isascii() and version.isdigit() and int(version) <= MAX_VERSION):
            raise ValueError(f"version: {version!r} is not a whole number in 0..2**62")
        return cls(query["run"], int(version))


def asks_in_flight(query) -> bool:
    """Whether /update is asked to merge between decoding steps, the completions under way kept."""
    return query.get("in_flight", "0") == "1"


def _loads(data: bytes):
    """A request's body as JSON; ValueError when it is not JSON the parser can read. Nested past Python's recursion
    limit (`[[[[...`), json raises RecursionError: a server's 500 where a bad request is a 400."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _fields(shape) -> dict:
    """A request's or answer's fields as a dict, the lists themselves (dataclasses.asdict would copy every token id
    and log-prob: seconds for a large batch, on the server's event loop)."""
    return {field.name: getattr(shape, field.name) for field in fields(shape)}


@dataclass(frozen=True)
class BlocksAsk:
    """/blocks: the named tensors (`seed` None), or their fingerprints (`sync.fingerprint` with that seed), as every
    worker holds its blocks, once the weights are a version of `run` at least `min_version` (waiting at most
    `wait_s`). With `any_run`, weights of another run (or unknown) are answered at once: a comparison finds them."""

    names: list[str]
    seed: int | None
    run: str | None
    min_version: int
    wait_s: float
    any_run: bool = False

    def to_bytes(self) -> bytes:
        return json.dumps(_fields(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> BlocksAsk:
        ask = cls(**_loads(data))
        ask.check()
        return ask

    def check(self) -> None:
        """ValueError naming the field a server could not honour."""
        if not (isinstance(self.names, list) and all(isinstance(name, str) for name in self.names)):
            raise ValueError("names: a list of tensor names")
        if not (self.seed is None or _whole(self.seed, 0, MAX_SEED)):
            raise ValueError(f"seed: {self.seed!r} is neither null nor a whole number in 0..2**62 - 1")
        _check_wait(self.run, self.min_version, self.wait_s)
        if type(self.any_run) is not bool:
            raise ValueError(f"any_run: {self.any_run!r} is not true or false")


def _check_wait(run, min_version, wait_s) -> None:
    """The fields of a request that waits for a version (/blocks, /generate)."""
    if not (run is None or isinstance(run, str)):
        raise ValueError(f"run: {run!r} is neither null nor a run's id")
    if not _whole(min_version, 0, MAX_VERSION):
        raise ValueError(f"min_version: {min_version!r} is not a whole number in 0..2**62")
    if not (is_number(wait_s) and wait_s >= 0):
        raise ValueError(f"wait_s: {wait_s!r} is not a number of seconds, at least 0")


@dataclass(frozen=True)
class GenerateAsk:
    """/generate: n completions of each prompt (token ids), prompt j seeded by seeds[j], at a weight version of `run`
    at least `min_version` (waiting at most `wait_s`)."""

    prompts: list[list[int]]
    seeds: list[int]
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop_token_ids: list[int]
    run: str | None
    min_version: int
    wait_s: float

    def to_bytes(self) -> bytes:
        return json.dumps(_fields(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> GenerateAsk:
        ask = cls(**_loads(data))
        ask.check()
        return ask

    def check(self) -> None:
        """ValueError naming the field a server could not honour: fewer seeds than prompts were answered with fewer
        outputs, and a seed of 2⁷⁰ failed inside vLLM with an empty message."""
        if not (isinstance(self.prompts, list) and isinstance(self.seeds, list)):
            raise ValueError("prompts and seeds: lists, one seed per prompt")
        if len(self.seeds) != len(self.prompts):
            raise ValueError(f"seeds: {len(self.seeds)} for {len(self.prompts)} prompts (one each)")
        if not all(_whole(seed, 0, MAX_SEED) for seed in self.seeds):
            raise ValueError("seeds: each must be a whole number in 0..2**62 - 1 (vLLM adds the sample's index)")
        if not _whole(self.n, 1, MAX_SAMPLES):
            raise ValueError(f"n: {self.n!r} is not a whole number in 1..{MAX_SAMPLES} (completions per prompt)")
        if not _whole(self.max_tokens, 1, MAX_VERSION):
            raise ValueError(f"max_tokens: {self.max_tokens!r} is not a positive whole number")
        if not (is_number(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature: {self.temperature!r} is not a number at least 0")
        if not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p: {self.top_p!r} is not a number in (0, 1]")
        if not all(isinstance(p, list) and p and all(_whole(t, 0, 2**63 - 1) for t in p) for p in self.prompts):
            raise ValueError("prompts: each must be a non-empty list of token ids")
        if not (isinstance(self.stop_token_ids, list) and all(_whole(t, 0, 2**63 - 1) for t in self.stop_token_ids)):
            raise ValueError(f"stop_token_ids: {self.stop_token_ids!r} is not a list of token ids")
        _check_wait(self.run, self.min_version, self.wait_s)


@dataclass(frozen=True)
class GenerateAnswer:
    """The weights' label when the generation started, and per prompt its n samples (in order), each
    {"token_ids": [...], "logprobs": [...] (the sampler's, one per token), "versions": [[version, start, end], ...]}
    (the weight versions that drew tokens start..end-1: more than one span where in-flight updates landed)."""

    run: str | None
    version: int
    outputs: list[list[dict]]

    def to_json(self) -> dict:
        return _fields(self)

    @classmethod
    def from_json(cls, data: dict) -> GenerateAnswer:
        return cls(**data)


def answer_problem(outputs: list[list[dict]], prompts: int, n: int, max_tokens: int, vocab_size: int | None
                   ) -> str | None:
    """What is wrong with a server's `GenerateAnswer.outputs` for `prompts` prompts of n samples each (None: nothing):
    a count that would pair one prompt's completion with another's, token ids outside the vocabulary, log-probs
    missing, NaN or positive."""
    if len(outputs) != prompts or any(len(samples) != n for samples in outputs):
        return (f"{[len(samples) for samples in outputs][:8]} samples for {prompts} prompts, where each has {n}")
    for samples in outputs:
        for sample in samples:
            ids, logprobs = sample.get("token_ids"), sample.get("logprobs")
            if not isinstance(ids, list) or not isinstance(logprobs, list) or len(logprobs) != len(ids):
                return "a sample whose token ids and log-probs are missing or of different lengths"
            if len(ids) > max_tokens:
                return f"a sample of {len(ids)} tokens, more than the {max_tokens} asked"
            if not all(type(t) is int and 0 <= t < (vocab_size or 2**63) for t in ids):
                return f"token ids outside the vocabulary (0..{vocab_size})"
            if not all(is_number(v) and v <= 1e-4 for v in logprobs):
                return "log-probs that are not finite numbers at most 0"
    return None


# What fixes a model's tensors' names and shapes: two models that agree on these take each other's weights (a
# fine-tune of the same base, another revision), two that differ cannot (a load or an update would be refused).
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def model_summary(config, name: str, dtype: str) -> dict:
    """What a server says of the model it serves: its name, its weights' dtype and the `SHAPE_KEYS` of its config (a
    transformers config of the text model, or a config.json's dict, whose text_config a multimodal one has)."""
    text = config.get("text_config", config) if isinstance(config, dict) else config
    read = text.get if isinstance(text, dict) else (lambda key: getattr(text, key, None))
    return {"name": name, "dtype": dtype, **{key: read(key) for key in SHAPE_KEYS if read(key) is not None}}


def model_differences(ours: dict, theirs: dict) -> list[str]:
    """The `SHAPE_KEYS` on which two `model_summary`s disagree ("hidden_size 128 here, 256 there"); a key that
    either lacks is not compared."""
    return [f"{key} {ours[key]} here, {theirs[key]} there" for key in SHAPE_KEYS
            if key in ours and key in theirs and ours[key] != theirs[key]]


def warn_if_others_can_read(path: str, key: str) -> None:
    """A token file that other users of the machine can read gives them the update routes: said, naming the fix."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # reading it says what is wrong
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("%s %s can be read by other users of this machine, who could then change the served weights: "
                    "chmod 600 %s", key, path, path)

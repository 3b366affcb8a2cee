"""The wire protocol between a trainer's `RemoteEngine` (`rollout/remote/`) and an engine server (`lightning-logra
serve`, `rollout/server/`): the shared token, the checksum header, the routes, and what each route is asked and
answers. Both sides import it; it imports neither (nor FastAPI, nor vLLM).

Every route lives under `/logra/`, needs `Authorization: Bearer <token>`, and carries the sha256 of its body in
`X-Logra-SHA256`. A server's weights are labelled with a run and a weight version (the number of updates merged since
the run's start); a route that needs another version than the server holds answers 409 with the server's label.

- GET  /logra/state                          → {"run", "version", "max_model_len", "model"} (`model_summary`), once
                                               a change under way has ended (503 if not soon: ask again)
- POST /logra/update?run&version[&in_flight=1] `Update` bytes, merged on top of version - 1 → the label
- POST /logra/load?run&version                whole tensors (`tensor_bytes.pack_tensors`), which leave the weights
                                               at the label
- POST /logra/blocks                         a BlocksAsk → safetensors bytes keyed "name|row|col"
- POST /logra/generate                       a GenerateAsk → a GenerateAnswer
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import stat
from dataclasses import dataclass, fields

TOKEN_ENV = "LOGRA_SERVER_TOKEN"  # the shared token, on both sides (a server may read it from --token-file instead)
PARENT_ENV = "LOGRA_SERVE_PARENT_PID"  # the trainer that launched a server (RemoteEngine's launch): it dies with it
SHA_HEADER = "X-Logra-SHA256"
PREFIX = "/logra"

log = logging.getLogger(__name__)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
        """?run=<id>&version=<int>; KeyError or ValueError when either is missing or malformed."""
        return cls(query["run"], int(query["version"]))


def asks_in_flight(query) -> bool:
    """Whether /update is asked to merge between decoding steps, the completions under way kept."""
    return query.get("in_flight", "0") == "1"


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
        return cls(**json.loads(data))


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
        ask = cls(**json.loads(data))
        ask.check()
        return ask

    def check(self) -> None:
        """ValueError naming the field a server could not honour: fewer seeds than prompts were answered with fewer
        outputs, and a seed of 2⁷⁰ failed inside vLLM with an empty message."""
        if len(self.seeds) != len(self.prompts):
            raise ValueError(f"seeds: {len(self.seeds)} for {len(self.prompts)} prompts (one each)")
        if not all(type(seed) is int and 0 <= seed < 2**62 for seed in self.seeds):
            raise ValueError("seeds: each must be a whole number in 0..2**62 - 1 (vLLM adds the sample's index)")
        if not (type(self.n) is int and self.n >= 1 and type(self.max_tokens) is int and self.max_tokens >= 1):
            raise ValueError(f"n and max_tokens must be positive whole numbers, got {self.n!r} and "
                             f"{self.max_tokens!r}")
        if not all(isinstance(p, list) and p and all(type(t) is int and t >= 0 for t in p) for p in self.prompts):
            raise ValueError("prompts: each must be a non-empty list of token ids")


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
            if not all(isinstance(v, (int, float)) and math.isfinite(v) and v <= 1e-4 for v in logprobs):
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

"""The `/logra/` routes of an engine server (the wire protocol: `rollout/protocol.py`): each a handler at module level
that reads what it needs from the app's state: vLLM's engine client (`app.state.engine_client`, set by vLLM's
`init_app_state`) and ours (`app.state.logra`: the token, the body bound and the version gate, set by `install`).

Every route checks the token first, and a body's size and sha256 before it parses it; an update or a load is parsed
whole, and checked by every worker, before any weight changes. Changes reach the workers (`vllm/worker.py`) through
`AsyncLLM.collective_rpc`. The token is the trust boundary: its holder may change every weight of a server no process
holds. While one holds it (`gate.VersionGate.held_by_another`), a request of another process, which cannot know the
holder's identity (the routes answer a tag of it), is refused 423.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) at definition.
import asyncio
import hmac
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus

from fastapi import APIRouter, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from lightning_logra.algo.update import Update
from lightning_logra.rollout.protocol import (
    PREFIX,
    PROCESS_HEADER,
    SHA_HEADER,
    TOKEN_ENV,
    BlocksAsk,
    GenerateAnswer,
    GenerateAsk,
    Label,
    asks_in_flight,
    model_summary,
    sha256,
)
from lightning_logra.rollout.server.gate import VersionGate
from lightning_logra.rollout.tensor_bytes import pack_tensors, unpack_tensors

router = APIRouter(prefix=PREFIX)
STATE_WAIT_S = 5.0  # /state waits this long for a change under way (the trainer's asks wait 10 s for an answer); then
# 503, and the trainer asks again later


@dataclass
class Guard:
    """What the routes of one server share besides vLLM's engine client."""

    token: str
    max_body_bytes: int
    gate: VersionGate = field(default_factory=VersionGate)


def install(app: FastAPI, token: str, max_body_bytes: int) -> None:
    """Mount the routes in `app`, each behind `token`, taking bodies of at most `max_body_bytes`."""
    app.state.logra = Guard(token, max_body_bytes)
    app.include_router(router)


def _guard(request: Request) -> Guard:
    return request.app.state.logra


def _engine(request: Request):
    return request.app.state.engine_client


def _process(request: Request) -> str | None:
    """The identity of the trainer process that sent the request (`protocol.new_process`)."""
    return request.headers.get(PROCESS_HEADER)


def _authorize(request: Request) -> None:
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {_guard(request).token}".encode()):
        raise HTTPException(HTTPStatus.UNAUTHORIZED, "a /logra/ route needs the server's token "
                            f"(Authorization: Bearer <${TOKEN_ENV}>)")


async def _body(request: Request) -> bytes:
    """The request's body, at most max_body_bytes, and equal to the sha256 it came with."""
    limit = _guard(request).max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and not (declared.isascii() and declared.isdigit()):
        raise HTTPException(HTTPStatus.BAD_REQUEST, f"Content-Length {declared[:40]!r} is not a number of bytes")
    if declared is not None and int(declared) > limit:
        raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over --max-body-mib ({limit} B)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over --max-body-mib ({limit} B)")
        chunks.append(chunk)
    data = b"".join(chunks)
    if request.headers.get(SHA_HEADER) != sha256(data):
        raise HTTPException(HTTPStatus.BAD_REQUEST, f"the body's sha256 differs from {SHA_HEADER}: cut short or "
                            "damaged on the way; nothing was changed")
    return data


def _label(request: Request) -> Label:
    try:
        return Label.from_query(request.query_params)
    except ValueError as err:
        raise HTTPException(HTTPStatus.BAD_REQUEST, f"give ?run=<id>&version=<int>: {err}") from err


def _ask(kind: type, data: bytes):
    """The request's body as `kind` (BlocksAsk, GenerateAsk); 400, naming what is wrong, when it is not one."""
    try:
        return kind.from_bytes(data)
    except (TypeError, ValueError) as err:  # a key missing or unknown, or not JSON the parser reads
        raise HTTPException(HTTPStatus.BAD_REQUEST, f"not a {kind.__name__}: {err}") from err


def _conflict(gate: VersionGate) -> JSONResponse:
    """409 with the weights' label: the server holds another version than the request needs."""
    return JSONResponse(gate.answer(), HTTPStatus.CONFLICT)


def _locked(gate: VersionGate, run: str | None, process: str | None) -> JSONResponse | None:
    """423 with the weights' label and how long their holder has been quiet, when another process than `process`
    of `run` holds the server (None: it does not)."""
    quiet = gate.held_by_another(run, process)
    if quiet is None:
        return None
    return JSONResponse(gate.answer(quiet_s=round(quiet, 1)), HTTPStatus.LOCKED)


async def _change(request: Request, kind: str, data: bytes, label: Label, in_flight: bool = False) -> bool:
    """Merge or load `data` with every worker, then label the weights. Drained (the default): once no generation of
    ours is under way and vLLM's own requests have finished (paused "wait"). In flight: between two decoding steps
    (paused "keep"), the completions under way kept: their tokens so far stay, their KV is computed again with the new
    weights (vLLM preempts them to empty its prefix cache), and their seeded sampling goes on where it was, so that
    every later token is a sample of the new weights given the tokens before it. Either way vLLM's engine is told the
    new version while paused, and labels each token it samples with the version that drew it. An update ("update",
    not "load") only if the weights are then the version before the label's (the gate's `change`); False if not.
    The workers check the payload against the weights it will change, under the gate: 400 if they find it wrong."""
    gate, client = _guard(request).gate, _engine(request)
    async with gate.change(label, in_flight, on_top=kind == "update") as admitted:
        if not admitted:
            return False
        await _refuse_problems(request, kind, data)
        await client.pause_generation(mode="keep" if in_flight else "wait", clear_cache=False)
        try:
            gate.forget()
            await client.collective_rpc("logra_apply" if kind == "update" else "logra_load", args=(data,))
            # Cached KV blocks were computed with the old weights: none may serve a later token.
            await client.reset_prefix_cache(reset_running_requests=in_flight)
            await client.update_weight_version(str(label.version))
            gate.relabel(label, _process(request))
        finally:
            await client.resume_generation()
    return True


async def _refuse_problems(request: Request, kind: str, data: bytes) -> None:
    """400, before the weights' label is touched, if any worker finds the payload wrong for its model (unknown
    names, other shapes, NaN or Inf, a projection the model's k does not allow, a rounding key the merge cannot use:
    `rollout.payload`; a merge whose result would not be finite: `sketch.update.merge_stays_finite`)."""
    answers = await _engine(request).collective_rpc("logra_payload_problems", args=(kind, data))
    problems = sorted({problem for answer in answers for problem in answer})
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise HTTPException(HTTPStatus.BAD_REQUEST, f"refused, nothing changed: {'; '.join(problems[:5])}{more}")


@router.get("/state")
async def state(request: Request):
    """The weights' label, the longest prompt + completion the server takes, and the model it serves (a trainer
    compares it with its own before it sends anything); once a change under way has ended (503 if it has not
    within STATE_WAIT_S: mid-change the weights are of no version)."""
    _authorize(request)
    gate = _guard(request).gate
    if not await gate.settled(STATE_WAIT_S):
        return JSONResponse(gate.answer(changing=True), HTTPStatus.SERVICE_UNAVAILABLE)
    config = _engine(request).model_config
    model = model_summary(config.hf_text_config, str(config.model), str(config.dtype).removeprefix("torch."))
    return gate.answer(max_model_len=config.max_model_len, model=model)


@router.post("/update")
async def update(request: Request):
    """An `Update`'s bytes; merged only on top of the version before it (409 with the server's label if not). With
    ?in_flight=1, between decoding steps, the completions being generated kept (`_change`). 423 while another
    process holds the server."""
    _authorize(request)
    label, gate, process = _label(request), _guard(request).gate, _process(request)
    if label.version < 1:
        raise HTTPException(HTTPStatus.BAD_REQUEST, "version: an update's is at least 1 (version 0: the model's files)")
    gate.heard_from(label.run, process)
    landing = asks_in_flight(request.query_params)
    data = await _body(request)
    locked = _locked(gate, label.run, process)
    if locked is not None:
        return locked
    if not gate.follows(label):
        return _conflict(gate)
    try:
        Update.from_bytes(data)  # parsed whole before any weight changes
    except Exception as err:
        raise HTTPException(HTTPStatus.BAD_REQUEST, f"not an Update: {err}") from err
    if not await _change(request, "update", data, label, landing):
        return _conflict(gate)
    return gate.answer()


@router.post("/load")
async def load(request: Request):
    """Whole tensors (`tensor_bytes.pack_tensors`), which leave the weights at the label given, held by the process
    that sent them; 423 while another process holds the server."""
    _authorize(request)
    label = _label(request)
    data = await _body(request)
    try:
        unpack_tensors(data)
    except Exception as err:
        raise HTTPException(HTTPStatus.BAD_REQUEST, f"not safetensors: {err}") from err
    gate = _guard(request).gate
    locked = _locked(gate, label.run, _process(request))  # another process's weights, and it is still at work
    if locked is not None:
        return locked
    await _change(request, "load", data, label)
    return gate.answer()


@router.post("/release")
async def release(request: Request):
    """The process that holds the server, of the run ?run=<id>&version=<int>, has ended: another may take the
    server at once. 423 from any other process (while one holds the server)."""
    _authorize(request)
    gate, label, process = _guard(request).gate, _label(request), _process(request)
    locked = _locked(gate, label.run, process)
    if locked is not None:
        return locked
    gate.release(label.run, process)
    return gate.answer()


@router.post("/blocks")
async def blocks(request: Request):
    """A `BlocksAsk`: the named tensors (or their fingerprints) as every worker holds its blocks, keyed
    "name|row|col", as safetensors bytes; 409 with the server's label if it does not reach the version in time."""
    _authorize(request)
    ask, gate = _ask(BlocksAsk, await _body(request)), _guard(request).gate
    gate.heard_from(ask.run, _process(request))
    async with gate.reading(ask.run, ask.min_version, ask.wait_s, ask.any_run) as reached:
        if not reached:
            return _conflict(gate)
        answers = await _engine(request).collective_rpc("logra_blocks", args=(list(ask.names), ask.seed))
    merged = {}
    for answer in answers:
        merged.update(unpack_tensors(answer))
    return Response(pack_tensors(merged), media_type="application/octet-stream")


@router.post("/generate")
async def generate(request: Request):
    """A `GenerateAsk`: n completions of each prompt (a `GenerateAnswer`), at a version at least min_version of its
    run; 409 with the server's label if it does not reach it in time; 423 while another process holds the server
    (two trainers resumed from one checkpoint would otherwise each generate from the other's weights)."""
    _authorize(request)
    ask, gate, process = _ask(GenerateAsk, await _body(request)), _guard(request).gate, _process(request)
    max_model_len = _engine(request).model_config.max_model_len
    if ask.max_tokens > max_model_len:
        raise HTTPException(HTTPStatus.BAD_REQUEST, f"not a GenerateAsk: max_tokens: {ask.max_tokens} is more than "
                            f"the server's max_model_len {max_model_len}")
    gate.heard_from(ask.run, process)
    locked = _locked(gate, ask.run, process)
    if locked is not None:
        return locked
    async with gate.generation(ask.run, ask.min_version, ask.wait_s) as reached:
        if not reached:
            return _conflict(gate)
        version = gate.version
        outputs = await asyncio.gather(*[_complete(_engine(request), ask, prompt, seed, version)
                                         for prompt, seed in zip(ask.prompts, ask.seeds)])
    return GenerateAnswer(gate.run, version, outputs).to_json()


async def _complete(client, ask: GenerateAsk, prompt: list[int], seed: int, version: int) -> list[dict]:
    """The n samples of one prompt, each with its tokens, the sampler's log-probs and the versions that drew them."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(n=ask.n, temperature=ask.temperature, top_p=ask.top_p, max_tokens=ask.max_tokens,
                            stop_token_ids=ask.stop_token_ids, logprobs=0, seed=seed, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    final = None
    async for output in client.generate({"prompt_token_ids": prompt}, params, uuid.uuid4().hex):
        final = output  # FINAL_ONLY: the one output, when the request is done
    return [{"token_ids": list(o.token_ids),
             "logprobs": [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)],
             "versions": [[_version(s.version, version), s.start, s.end] for s in o.weight_versions or []]}
            for o in sorted(final.outputs, key=lambda o: o.index)]


def _version(label: str, otherwise: int) -> int:
    """A token's weight version as vLLM labelled it: ours (a number) once this server changed its weights; before
    that vLLM's "default", the version the request started at."""
    return int(label) if label.isdigit() else otherwise

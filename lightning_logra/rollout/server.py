"""`lightning-logra serve`: vLLM's own OpenAI-compatible server, plus the routes that keep its weights in step with a
trainer elsewhere (`rollout/remote.py`, `RemoteEngine`).

One process serves `/v1/completions` (and the rest of vLLM's API) for evaluation and for people, and takes the
trainer's updates under `/logra/`: the same `Update` bytes a colocated engine takes (per sketched matrix the d×r
factor and A's seed), merged by the same worker extension (`vllm_worker.py`, reached through `AsyncLLM.collective_rpc`).
The server labels its weights with the trainer's run and weight version (the number of updates merged since the run's
start): an update applies only on top of the version before it, a generation request waits until the server holds the
version it asks for, and a server that fell behind is caught up by replaying the updates it missed (the trainer's
journal, `rollout/journal.py`).

Why a router mounted in vLLM's app, and not vLLM's own mechanisms (docs/design.md, "Engines apart from the trainer"):
`/collective_rpc` (dev mode) takes JSON strings only (bytes would travel base64, a third larger), lets a caller run
any worker method, and its switch also opens `/sleep`, `/pause` and the rest without authentication; the RL weight
API (`/update_weights`) moves whole tensors by NCCL or IPC, with no place for a merge W −= F·A. The app here is
vLLM's (`build_app`, `init_app_state`, `serve_http`), with one router more.

Safety: the server binds 127.0.0.1 unless `--host` says otherwise; every `/logra/` route needs the shared token
(`Authorization: Bearer …`, read from $LOGRA_SERVER_TOKEN or `--token-file`, never from the command line) and
refuses without it, changing nothing; payloads carry their sha256 and are parsed whole before any weight changes;
bodies are bounded (`--max-body-mib`). vLLM's own routes are as vLLM guards them (`--api-key`): docs/vllm.md says
what an exposed server allows.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) at definition.
import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import os
import sys
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus

log = logging.getLogger(__name__)

TOKEN_ENV = "LOGRA_SERVER_TOKEN"
SHA_HEADER = "X-Logra-SHA256"
_MAX_WAIT_S = 3600.0  # the longest a generation request may wait for the version it asks for


@dataclass
class Weights:
    """What the server's weights are: the trainer's run and weight version they equal (run None, version 0: the
    model's files, version 0 of any run that starts from them; version None: a load was cut short, unknown)."""

    run: str | None = None
    version: int | None = 0
    changing: bool = False  # an update or load is being merged: generation waits
    generating: int = 0  # generation requests under way: a change waits for them, unless it is in flight
    reading: int = 0  # weight reads (/blocks) under way: every change waits for them
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def label(self) -> dict:
        return {"run": self.run, "version": self.version}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _version(label: str, otherwise: int) -> int:
    """A token's weight version as vLLM labelled it: ours (a number) once this server changed its weights; before
    that vLLM's "default", the version the request started at."""
    return int(label) if label.isdigit() else otherwise


def read_token(token_file: str | None) -> str:
    """The shared token: the file's first line, or $LOGRA_SERVER_TOKEN; refused when there is neither, or it is
    shorter than 16 characters."""
    if token_file:
        try:
            with open(token_file) as file:
                token = file.readline().strip()
        except OSError as err:
            raise SystemExit(f"--token-file {token_file}: {err.strerror}") from err
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if len(token) < 16:
        raise SystemExit(f"lightning-logra serve: the update routes need a shared token of at least 16 characters: "
                         f"set ${TOKEN_ENV} or give --token-file (e.g. `python -c \"import secrets; "
                         f"print(secrets.token_hex(16))\" > token`); the trainer's RemoteEngine reads the same")
    return token


def build_router(token: str, max_body_bytes: int):
    """The `/logra/` routes (FastAPI), each behind the token."""
    from fastapi import APIRouter, HTTPException, Request, Response
    from fastapi.responses import JSONResponse

    router = APIRouter(prefix="/logra")
    weights = Weights()

    def authorize(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(HTTPStatus.UNAUTHORIZED, "a /logra/ route needs the server's token "
                                f"(Authorization: Bearer <${TOKEN_ENV}>)")

    async def body(request: Request) -> bytes:
        """The request's body, at most max_body_bytes, and equal to the sha256 it came with."""
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > max_body_bytes:
            raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over --max-body-mib ({max_body_bytes} B)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                    f"body over --max-body-mib ({max_body_bytes} B)")
            chunks.append(chunk)
        data = b"".join(chunks)
        if request.headers.get(SHA_HEADER) != sha256(data):
            raise HTTPException(HTTPStatus.BAD_REQUEST, f"the body's sha256 differs from {SHA_HEADER}: cut short or "
                                "damaged on the way; nothing was changed")
        return data

    def engine(request: Request):
        return request.app.state.engine_client

    async def change(request: Request, rpc: str, data: bytes, label: dict, on_top=None, in_flight=False) -> bool:
        """Merge or load `data` with every worker, then label the weights. Drained (the default): once no generation
        of ours is under way and vLLM's own requests have finished (paused "wait"). In flight: between two decoding
        steps (paused "keep"), the completions under way kept: their tokens so far stay, their KV is computed again
        with the new weights (vLLM preempts them to empty its prefix cache), and their seeded sampling goes on where
        it was, so that every later token is a sample of the new weights given the tokens before it. Either way
        vLLM's engine is told the new version while paused, and labels each token it samples with the version that
        drew it. With `on_top` (an update),
        only if the weights are then the version before the label's (checked under the lock: two updates of one
        version, one change); False if not."""
        client = engine(request)

        def free() -> bool:
            return not weights.changing and weights.reading == 0 and (in_flight or weights.generating == 0)

        async with weights.changed:
            await weights.changed.wait_for(free)
            if on_top is not None and not on_top():
                return False
            weights.changing = True
        try:
            await client.pause_generation(mode="keep" if in_flight else "wait", clear_cache=False)
            try:
                weights.version = None  # until the change is whole: a cut-short change leaves the weights unknown
                await client.collective_rpc(rpc, args=(data,))
                # Cached KV blocks were computed with the old weights: none may serve a later token.
                await client.reset_prefix_cache(reset_running_requests=in_flight)
                await client.update_weight_version(str(label["version"]))
                weights.run, weights.version = label["run"], label["version"]
            finally:
                await client.resume_generation()
        finally:
            async with weights.changed:
                weights.changing = False
                weights.changed.notify_all()
        return True

    def parse_label(request: Request) -> dict:
        try:
            return {"run": request.query_params["run"], "version": int(request.query_params["version"])}
        except (KeyError, ValueError) as err:
            raise HTTPException(HTTPStatus.BAD_REQUEST, "give ?run=<id>&version=<int>") from err

    @router.get("/state")
    async def state(request: Request):
        """The weights' label, and the longest prompt + completion the server takes."""
        authorize(request)
        return {**weights.label(), "max_model_len": engine(request).model_config.max_model_len}

    @router.post("/update")
    async def update(request: Request):
        """An `Update`'s bytes; merged only on top of the version before it (409 with the server's label if not).
        With ?in_flight=1, between decoding steps, the completions being generated kept (`change`)."""
        authorize(request)
        label = parse_label(request)
        in_flight = request.query_params.get("in_flight", "0") == "1"
        data = await body(request)

        def on_top() -> bool:
            return weights.run in (None, label["run"]) and weights.version == label["version"] - 1

        if not on_top():
            return JSONResponse(weights.label(), HTTPStatus.CONFLICT)
        from lightning_logra.algo.update import Update

        try:
            Update.from_bytes(data)  # parsed whole before any weight changes
        except Exception as err:
            raise HTTPException(HTTPStatus.BAD_REQUEST, f"not an Update: {err}") from err
        if not await change(request, "logra_apply", data, label, on_top, in_flight):
            return JSONResponse(weights.label(), HTTPStatus.CONFLICT)
        return weights.label()

    @router.post("/load")
    async def load(request: Request):
        """Whole tensors (`sync.pack_tensors`), which leave the weights at the label given."""
        authorize(request)
        label = parse_label(request)
        data = await body(request)
        from lightning_logra.rollout.sync import unpack_tensors

        try:
            unpack_tensors(data)
        except Exception as err:
            raise HTTPException(HTTPStatus.BAD_REQUEST, f"not safetensors: {err}") from err
        await change(request, "logra_load", data, label)
        return weights.label()

    async def at_version(ask: dict, counter: str) -> bool:
        """Wait (at most ask["wait_s"]) until the weights are a version of ask["run"] at least ask["min_version"]
        and no change is under way; then count a reader in (`counter`: "generating" or "reading"; `done` counts it
        out). False: not reached.
        With ask["any_run"], weights of another run (or unknown) are answered at once: a comparison finds them."""
        def ready() -> bool:
            if weights.changing:
                return False
            ours = weights.version is not None and weights.run in (None, ask["run"])
            if not ours:
                return bool(ask.get("any_run"))
            return weights.version >= ask["min_version"]

        async with weights.changed:
            if not ready():
                try:
                    await asyncio.wait_for(weights.changed.wait_for(ready), min(float(ask["wait_s"]), _MAX_WAIT_S))
                except TimeoutError:
                    return False
            setattr(weights, counter, getattr(weights, counter) + 1)
            return True

    async def done(counter: str) -> None:
        async with weights.changed:
            setattr(weights, counter, getattr(weights, counter) - 1)
            weights.changed.notify_all()

    @router.post("/blocks")
    async def blocks(request: Request):
        """{"names": [...], "seed": int | null, "run", "min_version", "wait_s", "any_run"}: the named tensors (or
        their fingerprints) as every worker holds its blocks, keyed "name|row|col", as safetensors bytes; 409 with
        the server's label if it does not reach the version within wait_s."""
        authorize(request)
        from lightning_logra.rollout.sync import pack_tensors, unpack_tensors

        ask = json.loads(await body(request))
        if not await at_version(ask, "reading"):
            return JSONResponse(weights.label(), HTTPStatus.CONFLICT)
        try:
            answers = await engine(request).collective_rpc("logra_blocks", args=(list(ask["names"]), ask.get("seed")))
        finally:
            await done("reading")
        merged = {}
        for answer in answers:
            merged.update(unpack_tensors(answer))
        return Response(pack_tensors(merged), media_type="application/octet-stream")

    @router.post("/generate")
    async def generate(request: Request):
        """{"prompts": [[ids]], "seeds": [...], "n", "temperature", "top_p", "max_tokens", "stop_token_ids", "run",
        "min_version", "wait_s"}: n completions of each prompt (tokens, the sampler's log-probs, and the versions
        that drew them: [[version, start, end], ...] over token indices, more than one span where in-flight updates
        landed), at a version at least min_version of that run; 409 with the server's label if it does not reach it
        within wait_s."""
        authorize(request)
        ask = json.loads(await body(request))
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not await at_version(ask, "generating"):
            return JSONResponse(weights.label(), HTTPStatus.CONFLICT)
        version = weights.version
        try:
            async def one(prompt: list[int], seed: int) -> list[dict]:
                params = SamplingParams(n=ask["n"], temperature=ask["temperature"], top_p=ask["top_p"],
                                        max_tokens=ask["max_tokens"], stop_token_ids=ask["stop_token_ids"],
                                        logprobs=0, seed=seed, detokenize=False,
                                        output_kind=RequestOutputKind.FINAL_ONLY)
                final = None
                async for output in engine(request).generate({"prompt_token_ids": prompt}, params, uuid.uuid4().hex):
                    final = output  # FINAL_ONLY: the one output, when the request is done
                return [{"token_ids": list(o.token_ids),
                         "logprobs": [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)],
                         "versions": [[_version(s.version, version), s.start, s.end] for s in o.weight_versions or []]}
                        for o in sorted(final.outputs, key=lambda o: o.index)]

            outputs = await asyncio.gather(*[one(p, s) for p, s in zip(ask["prompts"], ask["seeds"])])
        finally:
            await done("generating")
        return {"run": weights.run, "version": version, "outputs": outputs}

    return router


# ---- the command ------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-logra serve",
        description="A vLLM server (OpenAI-compatible: /v1/completions, /v1/chat/completions, ...) whose weights a "
                    "lightning-logra run keeps in step with its own by low-rank factors and seeds (model.engine: "
                    "RemoteEngine with this server's URL). The update routes (/logra/) need a shared token: set "
                    f"${TOKEN_ENV} or give --token-file, and give the trainer the same.",
        epilog="Any other vLLM server option goes after `--`, e.g. `-- --max-num-seqs 64 --api-key KEY`. "
               "The server binds 127.0.0.1 unless --host says otherwise; docs/vllm.md says what an exposed server "
               "allows.")
    parser.add_argument("--model", required=True,
                        help="the model the trainer starts from: a folder, a hub id or a fetched model's short name")
    parser.add_argument("--host", default="127.0.0.1", help="the address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on (default: %(default)s)")
    parser.add_argument("--token-file", help=f"a file whose first line is the shared token (else ${TOKEN_ENV})")
    parser.add_argument("--dtype", default="auto", help="the weights' dtype, as vLLM's (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, help="the longest prompt + completion")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="the share of device memory (host memory on the CPU backend) vLLM may take")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs each engine is sharded over")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="engines behind this one URL, each on its own GPUs (vLLM's data-parallel serving)")
    parser.add_argument("--max-body-mib", type=int, default=1024,
                        help="the largest update, load chunk or request the /logra/ routes take (default: "
                             "%(default)s MiB; the trainer's load chunks are 512 MiB)")
    parser.add_argument("--seed", type=int, default=0, help="vLLM's seed (the trainer seeds every request itself)")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def vllm_arguments(ours: argparse.Namespace, cpu_backend: bool = False) -> list[str]:
    """vLLM's `serve` command line for our options: the worker extension, log-probs at the sampling temperature (as
    the trainer computes them), and the options above; then whatever followed `--`. On the CPU backend the model
    runs eager unless what followed `--` says otherwise, as `VLLMEngine`'s does: the CPU has no CUDA graphs to
    capture, and vLLM's torch.compile would lengthen every start (about 35 s of a minute's start here)."""
    from lightning_logra.rollout.vllm import WORKER_EXTENSION, whole_prefills

    args = ["--model", ours.model, "--host", ours.host, "--port", str(ours.port), "--dtype", ours.dtype,
            "--gpu-memory-utilization", str(ours.gpu_memory_utilization),
            "--tensor-parallel-size", str(ours.tensor_parallel_size),
            "--data-parallel-size", str(ours.data_parallel_size), "--seed", str(ours.seed),
            "--worker-extension-cls", WORKER_EXTENSION, "--logprobs-mode", "processed_logprobs"]
    if ours.max_model_len is not None:
        args += ["--max-model-len", str(ours.max_model_len)]
    extra = ours.vllm_args[1:] if ours.vllm_args[:1] == ["--"] else ours.vllm_args
    given = {arg.split("=")[0] for arg in extra}
    if cpu_backend and not given & {"--enforce-eager", "--no-enforce-eager"}:
        args.append("--enforce-eager")
    if cpu_backend and not given & {"--enable-chunked-prefill", "--no-enable-chunked-prefill"}:
        # Prompts prefilled whole, as VLLMEngine's on the CPU backend (`whole_prefills` says why); a budget given
        # after `--` is the user's (vLLM refuses one below max_model_len)
        args.append("--no-enable-chunked-prefill")
        if "--max-num-batched-tokens" not in given:
            tokens = whole_prefills({"max_model_len": ours.max_model_len}, ours.model)["max_num_batched_tokens"]
            args += ["--max-num-batched-tokens", str(tokens)]
    return args + extra


async def _serve(args: argparse.Namespace, token: str, max_body_bytes: int) -> None:
    """vLLM's `run_server` with one router more: the engine client, vLLM's app and state, `serve_http`."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    from lightning_logra.rollout.vllm_compat import check_vllm

    check_vllm()
    listen_address, sock = setup_server(args, reuse_port=False)
    async with build_async_engine_client(args) as client:
        tasks = await client.get_supported_tasks()
        app = build_app(args, tasks, client.model_config)
        app.include_router(build_router(token, max_body_bytes))
        await init_app_state(client, app.state, args, tasks)
        log.warning("lightning-logra serve: %s on %s (update routes under /logra/)", args.model, listen_address)
        shutdown = await serve_http(app, sock=sock, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    access_log=not args.disable_uvicorn_access_log)
    try:
        await shutdown
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> None:
    from lightning_logra.paths import model_path

    ours = parser().parse_args(argv)
    try:
        ours.model = model_path(ours.model)  # a fetched model's short name is its folder in the cache
    except FileNotFoundError as error:
        raise SystemExit(f"lightning-logra serve --model: {error}") from None
    token = read_token(ours.token_file)
    if os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0"):
        raise SystemExit("lightning-logra serve: VLLM_SERVER_DEV_MODE is set; it opens vLLM's /collective_rpc, /pause "
                         "and weight routes to anyone who can reach the server, without a token: unset it")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import uvloop
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_arguments(ours, current_platform.is_cpu()))
    validate_parsed_serve_args(args)
    uvloop.run(_serve(args, token, ours.max_body_mib * 2**20))


if __name__ == "__main__":
    main(sys.argv[1:])

"""`lightning-logra serve`'s command line: our options and the vLLM options they become, the shared token, and vLLM's
`run_server` with the `/logra/` routes (`routes.py`) mounted in its app."""

import argparse
import logging
import os
import signal
import threading
import time

from lightning_logra.rollout.protocol import PARENT_ENV, TOKEN_ENV, warn_if_others_can_read

log = logging.getLogger(__name__)


def read_token(token_file: str | None) -> str:
    """The shared token: the file's first line, or $LOGRA_SERVER_TOKEN; refused when there is neither, or it is
    shorter than 16 characters."""
    if token_file:
        warn_if_others_can_read(token_file, "--token-file")
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


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-logra serve",
        description="A vLLM server (OpenAI-compatible: /v1/completions, /v1/chat/completions, ...) whose weights a "
                    "lightning-logra run keeps in step with its own by low-rank factors and seeds "
                    "(model.rollouts.engine: RemoteEngine with this server's URL). The update routes (/logra/) need a "
                    f"shared token: set ${TOKEN_ENV} or give --token-file, and give the trainer the same.",
        epilog="Any other vLLM server option goes after `--`, e.g. `-- --max-num-seqs 64 --api-key KEY`. The server "
               "binds 127.0.0.1 unless --host says otherwise; docs/vllm.md says what an exposed server allows.")
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
    from lightning_logra.rollout.vllm.kv_cache import CPU_BLOCK_TOKENS
    from lightning_logra.rollout.vllm.launch import WORKER_EXTENSION, whole_prefills

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
    if cpu_backend and "--block-size" not in given:
        args += ["--block-size", str(CPU_BLOCK_TOKENS)]  # a group's samples share their prompt's blocks (kv_cache.py)
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

    from lightning_logra.rollout.server.routes import install
    from lightning_logra.rollout.vllm.compat import check_vllm

    check_vllm()
    listen_address, sock = setup_server(args, reuse_port=False)
    async with build_async_engine_client(args) as client:
        tasks = await client.get_supported_tasks()
        app = build_app(args, tasks, client.model_config)
        install(app, token, max_body_bytes)
        await init_app_state(client, app.state, args, tasks)
        log.warning("lightning-logra serve: %s on %s (update routes under /logra/)", args.model, listen_address)
        shutdown = await serve_http(app, sock=sock, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    access_log=not args.disable_uvicorn_access_log)
    try:
        await shutdown
    finally:
        sock.close()


def die_with_parent(parent_pid: int) -> None:
    """A launched server leads a process group of its own (its engine core and workers are in it): once the trainer
    that launched it is gone (even by SIGKILL), the whole group is killed within a second. vLLM's API process, sent
    SIGTERM by the parent-death signal, waited minutes for its background tasks with a request pending, holding its
    port and its memory."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="logra-serve-watch-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    from lightning_logra.paths import checked_model_path

    if os.environ.get(PARENT_ENV, "").isdigit():
        die_with_parent(int(os.environ[PARENT_ENV]))

    ours = parser().parse_args(argv)
    try:
        # A fetched model's short name is its folder in the cache; a folder is checked against its SHA256SUMS, as
        # fit checks it, before vLLM loads it
        ours.model = checked_model_path(ours.model)
    except (OSError, ValueError) as error:  # not fetched, not a model folder, damaged (DamagedCheckpoint)
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

"""An engine server (`lightning-logra serve`, `python -m lightning_logra.rollout.server`): vLLM's own OpenAI-compatible
server, plus the routes that keep its weights in step with a trainer elsewhere (`rollout/remote/`, `RemoteEngine`).
This folder is what runs in the server's process; the trainer's side imports none of it, and shares with it only the
wire protocol (`rollout/protocol.py`).

One process serves `/v1/completions` (and the rest of vLLM's API) for evaluation and for people, and takes the
trainer's updates under `/logra/`: the same `Update` bytes a colocated engine takes (per sketched matrix the d×r
factor and A's seed), merged by the same worker extension (`vllm/worker.py`, reached through `AsyncLLM.collective_rpc`).
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
bodies are bounded (`--max-body-mib`), and so is every field of a request. The token is the trust boundary: a server
is held by the trainer process that made its weights, and refuses (423) every other process's change, generation
and release while that one is at work, but a holder of the token may change the weights of a server no process
holds. vLLM's own routes are as vLLM guards them (`--api-key`): docs/vllm.md says what an exposed server allows.

- command.py    the command line: our options and vLLM's, the token, vLLM's OpenAI app with the token-guarded
                `/logra/` routes mounted
- routes.py     the `/logra/` routes (update, load, blocks, generate at a weight version): handlers reading the app's
                state
- gate.py       VersionGate: the weights' run and version, who may touch them when, and which process holds the server
- __main__.py   `python -m lightning_logra.rollout.server`, as RemoteEngine launches its servers
"""

from lightning_logra.rollout.server.command import main

__all__ = ["main"]

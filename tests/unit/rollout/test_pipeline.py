"""The overlapped rollouts' pipeline (`lightning_logra.rollout.pipeline`) with an engine that records what it holds:
which weights each batch is drawn with, in what order the worker makes the calls, what a checkpoint saves of the
batches in flight, and what happens when the engine is lost. Engine-free and fast;
tests/integration/vllm/test_overlap.py runs it with vLLM."""

import signal
import threading
import time

import pytest
import torch

from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.base.stop import StopRequested
from lightning_logra.rollout.pipeline import EngineLost, RolloutPipeline


class Engine:
    """Holds the version of the weights it was sent (how many updates); a generation returns (step, version) in its
    completion ids, and is slow, so that the trainer's thread runs ahead of it."""

    def __init__(self) -> None:
        self.version, self.calls, self.threads = 0, [], set()
        self.fail_step = None  # the step whose generation meets a lost engine (once)

    def generate(self, batch, step):
        def call():
            self.threads.add(threading.current_thread().name)
            if step == self.fail_step:
                self.fail_step = None
                raise EngineLost("restarted")
            time.sleep(0.02)
            self.calls.append(("generate", step, self.version))
            ids = torch.tensor([[step, self.version]])
            return Rollout(ids, torch.ones_like(ids), ids, torch.ones_like(ids), torch.zeros(1, 2))

        return call

    def send(self, update):
        self.calls.append(("send", self.version))
        self.version += 1
        return {"sync/bytes": 1.0, "sync/seconds": 0.5}


def batches(start=0):
    step = start
    while True:
        yield {"prompt": [f"prompt of step {step}"]}
        step += 1


def pipeline(engine, k, start=0, last_step=None, reload=lambda: None):
    loader = batches(start)
    return RolloutPipeline(k, engine.generate, engine.send, reload, loader, start, last_step), batches(start)


def run(p, engine, steps, first=0):
    """The trainer's side of `steps` steps: take, then send the update; returns (step, version) per step."""
    drawn, lightning = [], batches(first)
    for step in range(first, first + steps):
        rollout, version, _ = p.take(next(lightning), step)
        assert rollout.completion_ids.tolist() == [[step, version]]  # drawn with exactly the weights of `version`
        drawn.append((step, version))
        p.send(Update())
    return drawn


@pytest.mark.parametrize("k", [1, 2, 3])
def test_step_t_is_drawn_with_the_weights_of_step_t_minus_k(k):
    engine = Engine()
    p, _ = pipeline(engine, k)
    assert run(p, engine, 8) == [(t, max(0, t - k)) for t in range(8)]
    p.drain()
    assert engine.version == 8  # every update reached the engine
    assert engine.threads == {t for t in engine.threads if t.startswith("rollouts")}  # all on the worker
    p.close()


def test_in_flight_an_update_lands_while_the_engine_generates_and_never_before_the_batchs_weights():
    """RemoteEngine(in_flight=True)'s pipeline: a send does not wait for the generation under way (it lands in it:
    the batch's later tokens are newer), and a generation starts only once the sends before it have landed."""
    engine = Engine()
    generate = engine.generate

    def slow(batch, step):  # (step, version at the first token, version at the last)
        def call():
            first = engine.version
            generate(batch, step)()
            time.sleep(0.2)
            ids = torch.tensor([[step, first, engine.version]])
            return Rollout(ids, torch.ones_like(ids), ids, torch.ones_like(ids), torch.zeros(1, 3))

        return call

    p = RolloutPipeline(1, slow, engine.send, lambda: None, batches(), 0, None, in_flight=True)
    lightning, drawn = batches(), []
    for step in range(5):
        rollout, version, _ = p.take(next(lightning), step)
        drawn.append(rollout.completion_ids[0].tolist())
        assert version == max(0, step - 1)
        p.send(Update())
    p.drain()
    assert engine.version == 5
    # Step t's batch starts with the weights of step t − 1 at least (k = 1) and ends with step t's: update t − 1,
    # sent as step t − 1 ended, did not wait for the 0.2 s generation under way (drained, the last would be t − 1)
    assert [(step, last) for step, _, last in drawn] == [(t, t) for t in range(5)]
    assert all(first >= max(0, step - 1) for step, first, _ in drawn)
    assert any(first < last for _, first, last in drawn)  # it landed during the generation (each time, unless late)
    assert {name.split("_")[0] for name in engine.threads} == {"rollouts"}
    p.close()


def test_nothing_is_generated_past_the_last_step_and_sends_are_reported_once():
    engine = Engine()
    p, _ = pipeline(engine, 2, last_step=4)
    run(p, engine, 5)
    p.drain()
    assert sorted(step for call, step, *_ in [c for c in engine.calls if c[0] == "generate"]) == [0, 1, 2, 3, 4]
    metrics = p.sent_metrics()
    assert metrics["sync/bytes"] == 5.0 and metrics["sync/seconds"] == 2.5  # summed over the sends since last time
    assert p.sent_metrics() == {}
    p.close()


def test_a_checkpoints_batches_in_flight_resume_as_if_uninterrupted():
    engine = Engine()
    p, _ = pipeline(engine, 2)
    uninterrupted = run(p, engine, 7)
    p.close()

    engine = Engine()
    p, _ = pipeline(engine, 2)
    run(p, engine, 3)
    saved = p.state()  # after step 2: the batches of steps 3 and 4, drawn with the weights of steps 1 and 2
    assert [(item["step"], item["version"]) for item in saved] == [(3, 1), (4, 2)]
    p.close()

    resumed = Engine()
    resumed.version = 3  # the resumed engine is loaded with the checkpoint's weights
    q, _ = pipeline(resumed, 2, start=3)
    q.restore(saved)
    assert run(q, resumed, 4, first=3) == uninterrupted[3:]
    # A smaller bound at the resume: both saved batches would be 2 steps stale, so both are drawn again, the first
    # with the resumed weights (the first step of a run has none older)
    smaller = Engine()
    smaller.version = 3
    r, _ = pipeline(smaller, 1, start=3)
    r.restore(saved)
    assert run(r, smaller, 3, first=3) == [(3, 3), (4, 3), (5, 4)]
    q.close()
    r.close()


def test_a_lost_engine_is_reloaded_on_the_trainers_thread_and_the_batches_in_flight_drawn_again():
    engine = Engine()
    reloads = []

    def reload():
        reloads.append(threading.current_thread().name)
        engine.version = engine_version_of_trainer[0]

    engine_version_of_trainer = [0]
    engine.fail_step = 3  # the generation of step 3, submitted in step 2, meets a lost engine
    p, _ = pipeline(engine, 1, reload=reload)
    lightning = batches()
    drawn = []
    for step in range(5):
        rollout, version, _ = p.take(next(lightning), step)
        drawn.append((step, version, rollout.completion_ids.tolist()))
        p.send(Update())
        engine_version_of_trainer[0] = step + 1
    assert reloads == [threading.main_thread().name]
    # Step 3's batch is drawn again with the trainer's weights of step 3; the lag resumes after it
    assert [(step, version) for step, version, _ in drawn] == [(0, 0), (1, 0), (2, 1), (3, 3), (4, 3)]
    assert all(ids == [[step, version]] for step, version, ids in drawn)
    p.close()


def test_a_loader_that_is_not_a_function_of_the_step_is_refused():
    engine = Engine()
    p, _ = pipeline(engine, 1)
    p.take({"prompt": ["prompt of step 0"]}, 0)
    with pytest.raises(RuntimeError, match="batches depend on the step alone"):
        p.take({"prompt": ["another prompt"]}, 1)
    p.close()


def test_after_a_signal_stopped_the_engine_a_checkpoint_keeps_the_batches_it_finished(caplog):
    engine = Engine()
    stopped_at = 3
    generate = engine.generate

    def generate_or_stop(batch, step):
        if step != stopped_at:
            return generate(batch, step)

        def call():  # what VLLMEngine's watch raises past the grace after a signal
            raise StopRequested(signal.SIGTERM, "a call to the engine still under way 30 s after it")

        return call

    engine.generate = generate_or_stop
    p, _ = pipeline(engine, 2)
    run(p, engine, 2)  # steps 0 and 1; the batches of steps 2 and 3 are in flight
    saved = p.state()  # does not raise: the checkpoint is being written for the signal
    assert [(item["step"], item["version"]) for item in saved] == [(2, 0)]
    assert "the resumed run generates the others again" in caplog.text
    with pytest.raises(StopRequested) as stop:  # the trainer waiting on step 3's batch stops with the signal
        p.take({"prompt": ["prompt of step 2"]}, 2)
        p.take({"prompt": ["prompt of step 3"]}, 3)
    assert stop.value.code == 143
    p.close()


def test_dynamic_samplings_later_rounds_are_drawn_with_the_steps_own_weights_even_after_a_lost_engine():
    # k = 1: a step's first round was drawn a step behind; its later rounds (call_now) come after every update sent
    # so far, so with the trainer's own weights of that step. The engine lost in one of them is reloaded with those.
    engine, reloads = Engine(), []
    trainer_version = [0]

    def reload():
        reloads.append(threading.current_thread().name)
        engine.version = trainer_version[0]

    p, _ = pipeline(engine, 1, reload=reload)
    lightning = batches()
    first, later = [], []
    for step in range(4):
        rollout, version, _ = p.take(next(lightning), step)
        first.append((step, version))
        if step == 2:
            engine.fail_step = 2  # the next call of step 2 meets a lost engine
        extra = p.call_now(engine.generate({"prompt": ["more"]}, step), step)
        later.append(extra.completion_ids.tolist())
        p.send(Update())
        trainer_version[0] = step + 1
    assert first == [(0, 0), (1, 0), (2, 1), (3, 2)]
    assert later == [[[step, step]] for step in range(4)]
    assert reloads == [threading.main_thread().name]
    p.close()

"""VLLMEngine's calls are watched (`_within_deadline`): an engine process that ends fails the call within a second or
two (EngineDied, and the engine is restarted), and so does a call still under way past the grace after a signal
(StopRequested, the engine killed, no restart), whatever `call_timeout_s` says. Engine-free: the call blocks on an
event, and the watched process is a `sleep`; tests/integration/vllm/ kills and stops real engines."""

import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from lightning_logra.base.stop import STOP, StopRequested
from lightning_logra.rollout.vllm import VLLMEngine
from lightning_logra.rollout.vllm.watchdog import EngineDied


@pytest.fixture
def engine(monkeypatch):
    engine = VLLMEngine(call_timeout_s=3600)  # not started: only the watch is exercised
    engine.killed = 0

    def kill():
        engine.killed += 1
        for process in engine._watched:
            process.kill()

    monkeypatch.setattr(engine, "_kill_processes", kill)
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    engine._watched = [psutil.Process(process.pid)]
    yield engine
    process.kill()
    process.wait()
    STOP.clear()


def _blocked(release: threading.Event):
    def call():
        release.wait(30)
        return "answered"

    return call


def test_a_call_returns_its_answer_while_the_engine_lives(engine):
    release = threading.Event()
    threading.Timer(0.2, release.set).start()
    assert engine._within_deadline(_blocked(release)) == "answered"
    assert engine.killed == 0


def test_an_engine_process_that_ends_fails_the_call_within_seconds(engine):
    release = threading.Event()
    threading.Timer(0.5, engine._watched[0].kill).start()
    start = time.monotonic()
    with pytest.raises(EngineDied):
        engine._within_deadline(_blocked(release))
    assert time.monotonic() - start < 5  # not call_timeout_s
    release.set()


def test_a_call_still_under_way_past_the_grace_after_a_signal_kills_the_engine_and_stops(engine):
    release = threading.Event()
    STOP.clear()
    STOP.request(signal.SIGTERM, grace_s=0.5)
    start = time.monotonic()
    with pytest.raises(StopRequested) as stopped:
        engine._within_deadline(_blocked(release))
    assert 0.5 <= time.monotonic() - start < 5
    assert stopped.value.code == 143 and engine.killed == 1
    # The next call does not reach the killed engine (nor restarts it): it stops at once
    with pytest.raises(StopRequested):
        engine._within_deadline(_blocked(release))
    release.set()


def test_a_call_that_answers_within_the_grace_is_untouched(engine):
    release = threading.Event()
    STOP.clear()
    STOP.request(signal.SIGTERM, grace_s=10)
    threading.Timer(0.3, release.set).start()
    assert engine._within_deadline(_blocked(release)) == "answered"
    assert engine.killed == 0

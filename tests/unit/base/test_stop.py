"""base/stop.py: a signal's stop is overdue once its grace has passed, and ends a process with the signal's status."""

import signal
import time

from lightning_logra.base.stop import STOP, StopRequested


def test_a_stop_is_overdue_after_its_grace_and_exits_with_the_signals_status():
    STOP.clear()
    assert not STOP.overdue()
    STOP.request(signal.SIGTERM, grace_s=0.2)
    assert not STOP.overdue()  # a wait may still finish within the grace
    time.sleep(0.25)
    assert STOP.overdue()
    STOP.request(signal.SIGUSR1, grace_s=0.2)  # a later signal does not restart the grace
    assert STOP.overdue()
    error = STOP.error("a call to the engine")
    assert isinstance(error, StopRequested) and isinstance(error, SystemExit)
    assert error.code == 128 + signal.SIGTERM and error.signum == signal.SIGTERM  # the highest signal received
    assert str(error) == "SIGTERM: a call to the engine still under way 0.2 s after it"
    STOP.clear()
    assert not STOP.overdue()

"""Log lines around the long waits of a run, where nothing else moves on the screen: what is being waited for when
it starts, and how long it took when it ends (a model loading, a dataset loading from the hub, an engine starting)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def waiting_for(what: str, log: logging.Logger) -> Iterator[None]:
    """Logs "<what> ..." at INFO on entry, and "<what>: done in 12.3 s" (or "failed after") on exit."""
    log.info("%s ...", what)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        log.info("%s: failed after %.1f s", what, time.perf_counter() - start)
        raise
    log.info("%s: done in %.1f s", what, time.perf_counter() - start)

"""This process's resident memory (RSS), read cheaply enough to sample every few milliseconds."""

from __future__ import annotations

import os
from collections.abc import Callable

_STATM = "/proc/self/statm"


def process_rss_reader() -> Callable[[], int]:
    """A function returning this process's resident set size in bytes: from /proc on Linux, else from psutil."""
    if os.path.exists(_STATM):
        page = os.sysconf("SC_PAGE_SIZE")

        def read() -> int:
            with open(_STATM) as statm:  # "size resident shared ...", counted in pages
                return int(statm.read().split()[1]) * page

        return read
    try:
        import psutil
    except ImportError:
        raise RuntimeError(
            f"MemoryProfiler: CPU memory is read from {_STATM} (Linux) or with psutil; this system has neither. "
            "Install psutil or remove lightning_logra.callbacks.MemoryProfiler from trainer.callbacks"
        ) from None
    process = psutil.Process()
    return lambda: process.memory_info().rss

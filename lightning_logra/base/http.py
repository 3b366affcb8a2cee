"""An HTTP request bounded as a whole. requests' timeout bounds each read, not the request: a server that trickles
its answer a byte at a time kept a caller waiting far past it (an engine server's generate, an LLM judge's verdict)."""

from __future__ import annotations

import threading
from typing import Any


def request_within(method: str, url: str, total_s: float, connect_s: float | None = None, **kwargs: Any):
    """`requests.request(method, url, **kwargs)`, its answer read whole within `total_s` seconds (connecting within
    `connect_s`, by default the same); past that, `requests.Timeout`. The request runs on a thread of its own, which
    a trickling server may keep a while longer: its session is closed so that nothing else waits on it."""
    import requests

    session, outcome = requests.Session(), {}

    def call() -> None:
        try:
            outcome["answer"] = session.request(method, url, timeout=(connect_s or total_s, total_s), **kwargs)
        except BaseException as err:  # handed to the caller
            outcome["error"] = err

    thread = threading.Thread(target=call, name="logra-http", daemon=True)
    thread.start()
    thread.join(total_s)
    if thread.is_alive():
        session.close()
        raise requests.Timeout(f"{method} {url}: no whole answer within {total_s} s")
    session.close()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["answer"]

"""A request bounded as a whole (base/http.py): a server that trickles its answer cannot keep the caller past its
deadline (requests' own timeout bounds each read, and a byte every 0.2 s never trips it)."""

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from lightning_logra.base.http import request_within


class Trickle(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        body = b"0123456789" * 3
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        slow = self.path == "/slow"
        for i in range(len(body)):
            self.wfile.write(body[i : i + 1])
            self.wfile.flush()
            if slow:
                time.sleep(0.2)

    def log_message(self, *args):
        pass


@pytest.fixture
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_a_trickled_answer_is_cut_at_the_deadline_and_a_prompt_one_arrives_whole(url):
    started = time.monotonic()
    with pytest.raises(requests.Timeout, match="no whole answer within 1.0 s"):
        request_within("GET", f"{url}/slow", 1.0)  # 30 bytes at 0.2 s each: 6 s
    assert time.monotonic() - started < 1.5
    assert request_within("GET", f"{url}/fast", 1.0).content == b"0123456789" * 3
    with pytest.raises(requests.ConnectionError):  # the request's own errors reach the caller
        request_within("GET", "http://127.0.0.1:1/", 1.0)

"""A real reward server for tests and benchmarks: ``http.server`` on 127.0.0.1 in a thread.

``RewardServer(score=...)`` answers ``POST /`` with ``score(payload)`` as JSON (``payload`` is the
request's decoded JSON). It records what it answered (``answers``: ``(payload, answer)`` in
arrival order) and the most requests it held at once (``max_in_flight``: received and not yet
answered; a request leaves flight just before its answer is sent). Knobs:

- ``delay``: seconds each request takes (an artificial model latency);
- ``fail_first``: the first N requests are answered ``fail_status`` (a flaky server);
- ``hang``: requests are held until the server closes (a server that never answers).

Used as a context manager; ``url`` is its address. HTTP/1.1 with keep-alive, one thread per
connection.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional, Tuple


class RewardServer:
    def __init__(
        self,
        score: Optional[Callable[[Dict[str, Any]], Any]] = None,
        *,
        delay: float = 0.0,
        fail_first: int = 0,
        fail_status: int = 500,
        hang: bool = False,
    ):
        self.score = score or (lambda payload: 1.0)
        self.delay, self.fail_first, self.fail_status, self.hang = delay, fail_first, fail_status, hang
        self.answers: List[Tuple[Dict[str, Any], Any]] = []
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._httpd: Optional[ThreadingHTTPServer] = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/reward"

    def __enter__(self) -> "RewardServer":
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                super().setup()  # headers and body go out in two writes: without NODELAY, Nagle holds the body ~40 ms
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with server._lock:
                    server.requests += 1
                    number = server.requests
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    if server.hang:
                        server._closing.wait(60)
                        return
                    if server.delay:
                        time.sleep(server.delay)
                    if number <= server.fail_first:
                        status, data = server.fail_status, b"server busy"
                    else:
                        payload = json.loads(body)
                        answer = server.score(payload)
                        with server._lock:
                            server.answers.append((payload, answer))
                        status, data = 200, json.dumps(answer).encode()
                finally:
                    # out of flight BEFORE the answer leaves: the client may send its next request as
                    # soon as it reads this one, so a later decrement would count both at once
                    with server._lock:
                        server.in_flight -= 1
                self._send(status, data)

            def _send(self, status: int, data: bytes):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # the default backlog of 5 drops concurrent connects (1 s SYN retries)

        self._httpd = Server(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._closing.set()
        self._httpd.shutdown()
        self._httpd.server_close()


def free_port() -> int:
    """A port nothing listens on (bound and released): a dead server's address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

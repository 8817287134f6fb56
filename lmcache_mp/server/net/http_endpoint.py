"""The HTTP port: /metrics for Prometheus, /healthz and /readyz for probes, served off the loop.

A thread of its own answers, so that a stuck event loop is seen (a probe served by the loop
would hang with it): /healthz reads the loop's heartbeat, /readyz flags any thread may read,
and /metrics asks the loop for a snapshot and gives up after a timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import cast

from ...errors import ServerCondition

logger = logging.getLogger("lmcache_mp.server.http")

# A probe's answer: None when all is well, else why not.
Probe = Callable[[], "str | None"]
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Unavailable(ServerCondition):
    """What /metrics answers 503 with: the loop did not hand over a snapshot in time."""


class HttpEndpoint:
    def __init__(self, host: str, port: int, render_metrics: Callable[[], bytes],
                 alive: Probe, ready: Probe):
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                endpoint.answer(self)

            def log_message(self, format: str, *args: object) -> None:
                logger.debug("%s %s", self.address_string(), format % args)

        self.render_metrics = render_metrics
        self.probes = {"/healthz": alive, "/readyz": ready}
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="http-endpoint",
                                        daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        # typeshed's server_address covers every family; an AF_INET(6) one is (host, port, ...)
        return cast(tuple[str, int], self._server.server_address[:2])

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                self._reply(request, 200, self.render_metrics(), METRICS_CONTENT_TYPE)
            except Unavailable as exc:
                self._reply(request, 503, f"{exc}\n".encode())
        elif path in self.probes:
            problem = self.probes[path]()
            self._reply(request, 503 if problem else 200, f"{problem or 'ok'}\n".encode())
        else:
            self._reply(request, 404, b"not found: try /metrics, /healthz or /readyz\n")

    @staticmethod
    def _reply(request: BaseHTTPRequestHandler, status: int, body: bytes,
               content_type: str = "text/plain; charset=utf-8") -> None:
        request.send_response(status)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

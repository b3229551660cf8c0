"""The head pod's probes (cluster/probe.py) against real sockets: a /health that answers
200 or 503, nothing listening, and a server that accepts and never answers."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cluster.probe import Health, Probe, main, passes, read_health
from cluster.testing import free_port


@contextmanager
def health_server(status: int) -> Iterator[int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            code = status if self.path == "/health" else 404
            self.send_response(code)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def silent_server() -> Iterator[int]:
    """Accepts connections and never answers (a hung proxy)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def run(probe: Probe, port: int) -> int:
    return main([probe.value, "--host", "127.0.0.1", "--port", str(port), "--timeout", "0.5"])


@pytest.mark.parametrize(("status", "health", "ready", "live"), [
    (200, Health.OK, 0, 0),
    (503, Health.UNHEALTHY, 1, 0),  # workers loading or recovering: out of the Service, alive
    (404, Health.UNHEALTHY, 1, 0),  # Serve up, the app not yet
])
def test_health_answers(status: int, health: Health, ready: int, live: int) -> None:
    with health_server(status) as port:
        assert read_health("127.0.0.1", port, 1.0)[0] is health
        assert (run(Probe.READY, port), run(Probe.LIVE, port)) == (ready, live)


def test_nothing_listening_passes_both_so_kuberay_can_deploy() -> None:
    port = free_port()
    health, line = read_health("127.0.0.1", port, 1.0)
    assert health is Health.NOT_LISTENING and str(port) in line
    assert run(Probe.READY, port) == 0 and run(Probe.LIVE, port) == 0


def test_a_hung_server_fails_both() -> None:
    with silent_server() as port:
        assert read_health("127.0.0.1", port, 0.3)[0] is Health.BROKEN
        assert run(Probe.READY, port) == 1 and run(Probe.LIVE, port) == 1


def test_decision_table() -> None:
    assert [passes(p, h) for p in Probe for h in Health] == [
        True, False, True, False,  # ready: ok, unhealthy, not listening, broken
        True, True, True, False,  # live
    ]

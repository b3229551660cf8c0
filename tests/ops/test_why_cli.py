"""`tierserve why REQ_ID` against a tiny local HTTP server serving a recorded answer."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cluster.cli import main
from cluster.why import explain
from scheduler.tiers import default_tiers


@pytest.fixture
def endpoint(scenario) -> Iterator[tuple[str, list[dict]]]:
    """Serves GET /v1/requests/X/why with explain()'s JSON; 404 with an OpenAI error body
    otherwise. Yields the base URL and the list of seen requests (path, auth header)."""
    answer = json.dumps(explain("X", scenario.logs, default_tiers()).to_dict()).encode()
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            seen.append({"path": self.path, "auth": self.headers.get("Authorization")})
            if self.path == "/v1/requests/X/why":
                status, body = 200, answer
            elif self.path == "/v1/requests/garbage/why":
                status, body = 200, b"<html>not json</html>"
            else:
                status, body = 404, json.dumps({"error": {
                    "message": "no request with id 'nope' in the last 10000 requests",
                    "type": "not_found_error", "code": 404}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_prints_the_causal_chain(endpoint, capsys) -> None:
    url, seen = endpoint
    assert main(["why", "X", "--url", url + "/", "--api-key", "k-123"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tier-0 request X waited 420 ms: KV full on decode-1; "
                             "preempted tier-3 request Y (swap, 80 ms)")
    assert "  3. [preempted_other] preempted tier-3 request Y (swap, 80 ms)" in out
    assert any("transfer crossed NVLink domains" in line for line in out)
    assert seen == [{"path": "/v1/requests/X/why", "auth": "Bearer k-123"}]


def test_json_output_is_the_answer(endpoint, capsys) -> None:
    url, _ = endpoint
    assert main(["why", "X", "--url", url, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["req_id"] == "X" and body["late"] is True
    assert [s["kind"] for s in body["steps"]][:3] == ["queued", "kv_full", "preempted_other"]


def test_unknown_request_is_a_clear_error(endpoint, capsys) -> None:
    url, seen = endpoint
    assert main(["why", "no pe", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "answered 404" in err and "no request with id" in err
    assert seen[-1]["path"] == "/v1/requests/no%20pe/why"
    assert main(["why", "garbage", "--url", url]) == 2
    assert "not JSON" in capsys.readouterr().err


def test_unreachable_endpoint(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["why", "X", "--url", f"http://127.0.0.1:{port}", "--timeout", "5"]) == 2
    assert "cannot reach" in capsys.readouterr().err

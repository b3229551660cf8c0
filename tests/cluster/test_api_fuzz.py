"""Fuzzing the HTTP layer in process, over the fake backend (issue 13 item 5): at least
200 generated requests per endpoint from the served /openapi.json, with keys configured;
no 5xx, every error an OpenAI-style JSON body, and the app still answers after."""

from __future__ import annotations

from typing import Any

from .api_fuzz import FuzzReport, fuzz, request_of
from .test_router_access import KEY_GOLD, TENANTS, auth, make
from .test_router_http import MODEL

EXAMPLES = 70  # per run, three runs: 210 requests per endpoint


def test_fuzzed_requests_get_no_5xx() -> None:
    client, backend = make(TENANTS, max_body_bytes=64 << 10)
    raw = client.get("/openapi.json", headers=auth(KEY_GOLD)).json()

    def send(case: Any, extra: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        r = client.request(**request_of(case, extra))
        return r.status_code, dict(r.headers), r.content

    report: dict[str, FuzzReport] = {}
    fuzz(raw, MODEL, send, examples=EXAMPLES, report=report, key=KEY_GOLD)
    print({path: dict(rep.statuses) for path, rep in report.items()})
    for path, rep in report.items():
        assert rep.num_requests >= 200, (path, rep.statuses)
        assert rep.failures == [], (path, rep.failures[:5])
    # Generated bodies got through to the backend, not only refusals.
    assert report["/v1/completions"].statuses[200] > 0 and backend.specs
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                    headers=auth(KEY_GOLD))
    assert r.status_code == 200

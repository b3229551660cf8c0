"""Property-based fuzzing of the HTTP API from its own OpenAPI document (schemathesis over
hypothesis), shared by the in-process and the live-cluster fuzz tests.

For each operation, bounded runs: requests valid against the schema as served, the same
with ``model`` fixed to the served model (so generated bodies reach tokenization,
admission and the engine, not only the 404 for an unknown model), and requests that break
the schema (negative mode). Each request also gets fuzzed headers: the caller's valid
key or a random one, and a random ``x-tierserve-tier`` now and then. Every answer must be below 500 and, when it is an error, an
OpenAI-style JSON body; the caller's ``send`` bounds each request's time (a hang fails).
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
              ("GET", "/v1/models"), ("GET", "/v1/requests/{req_id}/why")]

# (case, extra headers) -> (status, headers, body bytes) of one generated request.
Send = Callable[[Any, dict[str, str]], tuple[int, dict[str, str], bytes]]

_PRINTABLE = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40)


def _headers(key: str | None) -> st.SearchStrategy[dict[str, str]]:
    auth = st.sampled_from([f"Bearer {key}"] * 3 if key else [""]) | _PRINTABLE.map(
        lambda s: f"Bearer {s}")
    tier = st.none() | st.integers(-2, 9).map(str) | _PRINTABLE
    # HTTP forbids a header value with white space at either end: a client refuses to send it.
    return st.builds(lambda a, t: {k: v.strip() for k, v in (("authorization", a),
                                                              ("x-tierserve-tier", t))
                                   if v and v.strip()}, auth, tier)


@dataclass
class FuzzReport:
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def num_5xx(self) -> int:
        return sum(n for s, n in self.statuses.items() if s >= 500)


def _with_model(raw: dict[str, Any], model: str) -> dict[str, Any]:
    fixed = copy.deepcopy(raw)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        fixed["components"]["schemas"][name]["properties"]["model"] = {"const": model}
    return fixed


def _check(report: FuzzReport, what: str, status: int, headers: dict[str, str],
           body: bytes) -> None:
    report.statuses[status] += 1
    if status >= 500:
        report.failures.append(f"{what}: {status} {body[:300]!r}")
        return
    if status >= 400:
        try:
            err = json.loads(body)["error"]
            assert err["message"] and err["type"]
        except (ValueError, KeyError, TypeError, AssertionError):
            report.failures.append(f"{what}: {status} without an OpenAI error body: "
                                   f"{body[:300]!r}")


def request_of(case: Any, extra: dict[str, str]) -> dict[str, Any]:
    """The generated request as plain ``method, url, headers, content`` (httpx keywords);
    the body always goes as JSON bytes under application/json (the content type alone is
    tested elsewhere)."""
    headers = {k: str(v) for k, v in (case.headers or {}).items()}
    headers.update(extra)
    # What an HTTP client can send at all: no white space at either end, latin-1 only.
    headers = {k: v.strip() for k, v in headers.items()
               if v.strip() and v.isascii() and v.isprintable()}
    out: dict[str, Any] = {"method": case.method, "url": case.formatted_path,
                           "params": case.query or None, "headers": headers}
    if not isinstance(case.body, type(None)) and type(case.body).__name__ != "NotSet":
        body = case.body
        out["content"] = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers["content-type"] = "application/json"
    return out


def fuzz(raw_schema: dict[str, Any], model: str, send: Send, *, examples: int,
         report: dict[str, FuzzReport], key: str | None = None) -> None:
    """Fuzz every operation of OPERATIONS with 3 x ``examples`` requests (at most: an
    operation with few distinct requests may run fewer); ``key``: a valid API key, sent
    most of the time."""
    runs = [(raw_schema, GenerationMode.POSITIVE), (_with_model(raw_schema, model),
                                                    GenerationMode.POSITIVE),
            (raw_schema, GenerationMode.NEGATIVE)]
    for method, path in OPERATIONS:
        rep = report.setdefault(path, FuzzReport())
        chosen = runs if method == "POST" else [runs[0], runs[0], runs[2]]
        for i, (raw, mode) in enumerate(chosen):
            op = schemathesis.openapi.from_dict(raw)[path][method]
            _run(op.as_strategy(generation_mode=mode), send, rep,
                 f"{method} {path} ({mode.value})", examples, i, key)


def _run(strategy: Any, send: Send, rep: FuzzReport, what: str, examples: int, run_seed: int,
         key: str | None) -> None:
    @seed(run_seed)  # reproducible runs, a different one each time
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy, _headers(key))
    def run(case: Any, extra: dict[str, str]) -> None:
        status, headers, body = send(case, extra)
        _check(rep, what, status, headers, body)

    run()

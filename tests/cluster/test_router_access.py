"""Access control and input limits of the HTTP layer over a fake backend (issue 13 items
6 to 8): keys on every endpoint but /health, checked before the body is read; JSON only;
a body limit; /why per tenant; the tier ceiling; every field range-checked; every error an
OpenAI-style JSON body. The reproductions of the issue are here by name."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient

from router.app import RouterSettings, build_app
from router.tenants import TenantDirectory, TenantEntry

from .test_router_http import MODEL, ByteTokenizer, FakeBackend

KEY_GOLD, KEY_FREE = "sk-gold-0123456789", "sk-free-9876543210"
TENANTS = [TenantEntry.with_keys("gold", (KEY_GOLD,), 0, False),
           TenantEntry.with_keys("free", (KEY_FREE,), 2, True),
           TenantEntry.with_keys("trusted", ("sk-trusted",), 2, True, max_tier_override=0)]
BODY = {"model": MODEL, "prompt": "x", "max_tokens": 2}


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.num_encodes = 0

    def encode_prompt(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.num_encodes += 1
        return super().encode_prompt(text)


class Backend(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.tok = CountingTokenizer()
        self.fail_metrics = False

    @property
    def tokenizer(self) -> CountingTokenizer:
        return self.tok

    async def metrics(self) -> tuple[bytes, str]:
        if self.fail_metrics:
            raise RuntimeError("boom")
        return await super().metrics()


def make(tenants: list[TenantEntry] | None = None, **settings: Any
         ) -> tuple[TestClient, Backend]:
    backend = Backend()
    app = build_app(backend, tenants=TenantDirectory(tenants or [], num_tiers=4),
                    settings=RouterSettings(max_tokens_limit=100, **settings))
    return TestClient(app, raise_server_exceptions=False), backend


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def assert_openai_error(r: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if code is not None:
        assert err["code"] == code, err
    return err


def test_every_endpoint_but_health_needs_a_key() -> None:
    client, backend = make(TENANTS)
    for method, path in [("GET", "/v1/models"), ("GET", "/openapi.json"), ("GET", "/metrics"),
                         ("GET", "/v1/requests/known/why"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/v2/nothing")]:
        for headers in ({}, auth("sk-wrong"), {"authorization": KEY_GOLD}):
            r = client.request(method, path, json=BODY, headers=headers)
            assert_openai_error(r, 401, "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models", headers=auth(KEY_GOLD)).status_code == 200
    assert client.get("/openapi.json", headers=auth(KEY_FREE)).status_code == 200
    assert client.get("/metrics", headers=auth(KEY_FREE)).status_code == 200
    assert backend.specs == []


def test_metrics_open_by_configuration() -> None:
    client, _ = make(TENANTS, open_metrics=True)
    assert client.get("/metrics").status_code == 200
    assert_openai_error(client.get("/v1/models"), 401)


def test_key_is_checked_before_the_body_is_read() -> None:
    client, _ = make(TENANTS, max_body_bytes=2048)
    # Malformed and oversized bodies from a caller without a key: 401, not 400 or 413.
    r = client.post("/v1/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert_openai_error(r, 401)
    r = client.post("/v1/completions", content=b"x" * 10_000,
                    headers={"content-type": "application/json"})
    assert_openai_error(r, 401)


def test_only_json_bodies_are_accepted() -> None:
    client, backend = make()
    raw = json.dumps(BODY).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                  None):
        headers = {} if ctype is None else {"content-type": ctype}
        r = client.post("/v1/completions", content=raw, headers=headers)
        assert_openai_error(r, 415, "unsupported_media_type")
    r = client.post("/v1/completions", content=raw,
                    headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and len(backend.specs) == 1


def test_body_limit_declared_and_streamed() -> None:
    client, backend = make(max_body_bytes=4096)
    big = json.dumps({**BODY, "prompt": "a" * 8000}).encode()
    r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert_openai_error(r, 413, "body_too_large")

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    r = client.post("/v1/completions", content=chunks(),
                    headers={"content-type": "application/json"})
    assert_openai_error(r, 413, "body_too_large")
    assert backend.specs == [] and backend.tok.num_encodes == 0


def test_why_is_per_tenant() -> None:
    client, backend = make(TENANTS)
    assert client.get("/v1/requests/known/why", headers=auth(KEY_GOLD)).status_code == 200
    assert backend.why_tenants == ["gold"]
    open_client, open_backend = make()
    assert open_client.get("/v1/requests/known/why").status_code == 200
    assert open_backend.why_tenants == [None]


def test_tier_override_has_a_ceiling() -> None:
    client, backend = make(TENANTS)
    # free (tier 2, may override): down to 3 yes, up to 1 or 0 no.
    r = client.post("/v1/completions", json={**BODY, "priority": 3}, headers=auth(KEY_FREE))
    assert r.status_code == 200 and backend.specs[-1].tier == 3
    for asked in (0, 1):
        r = client.post("/v1/completions", json=BODY,
                        headers={**auth(KEY_FREE), "x-tierserve-tier": str(asked)})
        assert_openai_error(r, 403, "tier_not_allowed")
    # trusted: configured up to tier 0.
    r = client.post("/v1/completions", json={**BODY, "priority": 0}, headers=auth("sk-trusted"))
    assert r.status_code == 200 and backend.specs[-1].tier == 0
    # gold may not override at all.
    r = client.post("/v1/completions", json={**BODY, "priority": 1}, headers=auth(KEY_GOLD))
    assert_openai_error(r, 403, "tier_not_allowed")


def test_keys_never_appear_in_logs_or_answers(caplog: pytest.LogCaptureFixture) -> None:
    client, _ = make(TENANTS)
    caplog.set_level(logging.DEBUG)
    answers = [client.post("/v1/completions", json=BODY, headers=auth(KEY_GOLD)).text,
               client.post("/v1/completions", json=BODY, headers=auth(KEY_GOLD + "x")).text,
               client.get("/v1/models", headers={"authorization": f"Basic {KEY_FREE}"}).text]
    for text in [caplog.text, *answers]:
        assert KEY_GOLD not in text and KEY_FREE not in text
    assert KEY_GOLD not in repr(TENANTS[0])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"seed": 2**64}, "seed"),  # issue 13: 500 with plain text
        ({"seed": -(2**63) - 1}, "seed"),
        ({"prompt": "a\ud800b"}, "prompt"),  # issue 13: lone surrogate, 500 with plain text
        ({"stop": ["\udfff"]}, "stop"),
        ({"prompt": [1, 2, 256]}, "prompt"),  # issue 13: out of the vocabulary, 500 after retries
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": [1, 2**64]}, "prompt"),
        ({"stop": "s" * 257}, "stop"),
        ({"max_tokens": 10**40}, "max_tokens"),
    ],
)
def test_every_field_is_range_checked(body: dict[str, Any], param: str) -> None:
    client, backend = make()
    raw = json.dumps({**BODY, **body})  # ASCII: a lone surrogate travels as its escape
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    err = assert_openai_error(r, 400)
    assert err["param"].startswith(param), err
    assert backend.specs == []


@pytest.mark.parametrize("raw", [b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
                                 b'{"model": "tiny", "prompt": "x", "top_p": Infinity}',
                                 b'{"model": "tiny", "prompt": "x", "max_tokens": 1e999}',
                                 b'{"model": "tiny", "prompt": "x", "seed": ' + b"9" * 5000 + b"}",
                                 b"[" * 100_000 + b"]" * 100_000,
                                 b'{"model": "tiny", "prompt": "\\ud800"}'])
def test_malformed_json_is_a_400(raw: bytes) -> None:
    client, backend = make(max_body_bytes=1 << 20)
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    assert backend.specs == []


def test_prompt_far_over_the_context_is_refused_without_tokenizing() -> None:
    client, backend = make()  # context 64 tokens, at most 1 byte a token
    r = client.post("/v1/completions", json={**BODY, "prompt": "a" * 5000})
    err = assert_openai_error(r, 400, "context_length_exceeded")
    assert "at least 5000" in err["message"]
    assert backend.tok.num_encodes == 0


def test_unexpected_errors_are_json_500s() -> None:
    client, backend = make()
    backend.fail_metrics = True
    err = assert_openai_error(client.get("/metrics"), 500, "internal_error")
    assert "boom" not in err["message"]


def test_openapi_publishes_the_request_bodies() -> None:
    client, _ = make(TENANTS)
    schema = client.get("/openapi.json", headers=auth(KEY_GOLD)).json()
    comps = schema["components"]["schemas"]
    for path, name in (("/v1/chat/completions", "ChatCompletionRequest"),
                       ("/v1/completions", "CompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"]["$ref"].endswith(name)
        assert "model" in comps[name]["required"]
    assert comps["CompletionRequest"]["properties"]["seed"]["anyOf"][0]["maximum"] == 2**63 - 1
    assert schema["security"] == [{"bearer": []}]

"""The HTTP layer over a fake backend: OpenAI shapes, SSE, errors, tenants, aborts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from router.app import RequestTiming, RouterSettings, build_app
from router.backend import BackendError, BackendErrorKind, FinishReason, GenerationSpec, TokenDelta
from router.tenants import TenantDirectory, TenantEntry

MODEL = "tiny"
REPLY = "hello world. bye"


class ByteTokenizer:
    vocab_size = 256
    max_token_bytes = 1
    tool_format = None

    def encode_prompt(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def encode_chat(self, messages: Sequence[dict[str, Any]], **template: Any) -> list[int]:
        return list("".join(f"<{m['role']}>{m['content']}" for m in messages).encode())

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode(errors="replace")

    def token_text(self, token_id: int) -> str:
        return bytes([token_id]).decode(errors="replace")


class FakeBackend:
    """Replies REPLY byte by byte (EOS after it); records specs and aborts."""

    def __init__(self) -> None:
        self.specs: list[GenerationSpec] = []
        self.aborted: list[str] = []
        self.reject = False
        self.hang = False
        self.why_tenants: list[str | None] = []

    @property
    def model_name(self) -> str:
        return MODEL

    @property
    def max_model_len(self) -> int:
        return 64

    @property
    def model_root(self) -> str:
        return "/models/tiny"

    @property
    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer()

    async def generate(self, spec: GenerationSpec) -> AsyncIterator[TokenDelta]:
        self.specs.append(spec)
        if self.reject:
            raise BackendError(BackendErrorKind.REJECTED, "overloaded", retry_after_s=2.0)
        reply = REPLY.encode()
        n = min(spec.sampling.max_tokens, len(reply))
        for i in range(n):
            if self.hang and i == 2:
                await asyncio.sleep(3600)
            done = i == n - 1
            finish = None
            if done:
                finish = FinishReason.LENGTH if n == spec.sampling.max_tokens else FinishReason.STOP
            yield TokenDelta((reply[i],), finish)
            await asyncio.sleep(0)

    async def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)

    async def health(self) -> dict[str, Any]:
        return {"ok": True, "workers": 2}

    async def why(self, req_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        self.why_tenants.append(tenant)
        return {"req_id": req_id, "text": "on time"} if req_id == "known" else None

    async def metrics(self) -> tuple[bytes, str]:
        return b"tierserve_up 1\n", "text/plain"


class Observer:
    def __init__(self) -> None:
        self.done: list[RequestTiming] = []

    def on_request_done(self, timing: RequestTiming) -> None:
        self.done.append(timing)


def make_client(tenants: list[TenantEntry] | None = None, **settings: Any):
    backend = FakeBackend()
    observer = Observer()
    app = build_app(backend, tenants=TenantDirectory(tenants or [], num_tiers=4),
                    settings=RouterSettings(max_tokens_limit=100, **settings), observer=observer)
    return TestClient(app), backend, observer


def sse_events(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_non_streaming_returns_text_and_usage() -> None:
    client, backend, observer = make_client()
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 50, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt_len = len("<user>hi")
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": len(REPLY),
                             "total_tokens": prompt_len + len(REPLY),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert backend.specs[0].sampling.temperature == 0.0
    assert backend.specs[0].tier == 1
    assert observer.done[0].outcome == "stop" and observer.done[0].completion_tokens == len(REPLY)


def test_completion_length_and_stop_string() -> None:
    client, backend, _ = make_client()
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5})
    assert r.json()["choices"][0] == {"index": 0, "text": "hello", "logprobs": None,
                                      "finish_reason": "length", "stop_reason": None}
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stop": [". "]})
    choice = r.json()["choices"][0]
    assert choice["text"] == "hello world" and choice["finish_reason"] == "stop"
    assert backend.specs[-1].req_id in backend.aborted  # stopped early: blocks freed


def test_streaming_chat_with_usage() -> None:
    client, _, _ = make_client()
    with client.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == REPLY
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(REPLY)


def test_streaming_stop_string_is_never_sent() -> None:
    client, _, _ = make_client()
    with client.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "x", "stream": True, "stop": "ld."}) as r:
        events = sse_events(r.read().decode())
    text = "".join(c["choices"][0]["text"] for c in events[:-1])
    assert text == "hello wor"


@pytest.mark.parametrize(
    ("payload", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                     "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                     "max_tokens": 101}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                     "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                     "temperature": 5}).encode(), 400, "temperature"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a" * 80}]}).encode(),
         400, "messages"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a" * 30}],
                     "max_tokens": 50}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "a"}]}).encode(),
         404, "model"),
    ],
)
def test_bad_input_gets_openai_error(payload: bytes, status: int, param: str | None) -> None:
    client, backend, _ = make_client()
    r = client.post("/v1/chat/completions", content=payload,
                    headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"].startswith(param)
    assert backend.specs == []


def test_api_keys_and_tiers() -> None:
    tenants = [TenantEntry.with_keys("gold", ("k-gold",), 0, True),
               TenantEntry.with_keys("free", ("k-free",), 3, False)]
    client, backend, _ = make_client(tenants)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 401
    r = client.post("/v1/completions", json=body, headers={"authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    ok = client.post("/v1/completions", json=body, headers={"authorization": "Bearer k-free"})
    assert ok.status_code == 200 and backend.specs[-1].tier == 3
    r = client.post("/v1/completions", json={**body, "priority": 0},
                    headers={"authorization": "Bearer k-free"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "tier_not_allowed"
    r = client.post("/v1/completions", json=body,
                    headers={"authorization": "Bearer k-gold", "x-tierserve-tier": "2"})
    assert r.status_code == 200 and backend.specs[-1].tier == 2
    r = client.post("/v1/completions", json=body,
                    headers={"authorization": "Bearer k-gold", "x-tierserve-tier": "9"})
    assert r.status_code == 400


def test_backend_errors_map_to_statuses() -> None:
    client, backend, observer = make_client()
    backend.reject = True
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == "rejected"
    assert observer.done[-1].outcome == "rejected"


def test_timeout_aborts_request() -> None:
    client, backend, _ = make_client(request_timeout_s=0.2)
    backend.hang = True
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 504
    assert backend.aborted == [backend.specs[0].req_id]


def test_models_health_metrics_why() -> None:
    client, _, _ = make_client()
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/metrics").text == "tierserve_up 1\n"
    assert client.get("/v1/requests/known/why").status_code == 200
    r = client.get("/v1/requests/unknown/why")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert client.get("/v2/nothing").status_code == 404

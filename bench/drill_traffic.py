"""The drill's traffic (``bench/drill.py``): streaming completions read chunk by chunk,
probe requests, and the reads of /health, /v1/models and /metrics, over HTTP to the
endpoint under drill only.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 10.0
WATCH_S = 120.0  # a stream still open this long after the fault counts as unresolved


@dataclass(slots=True)
class StreamResult:
    index: int
    is_long: bool
    req_id: str = ""  # the server's id (x-tierserve-request-id): `tierserve why` explains it
    completed: bool = False
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    num_chunks: int = 0
    num_chunks_at_fault: int = 0
    end_s: float | None = None  # seconds after the fault it ended; None: did not end
    # The longest silence after the fault: to its first token (or end) and between tokens.
    max_gap_s: float | None = None
    identical: bool | None = None
    in_flight: bool = True  # False: it had ended (or been refused) before the fault


def drill_prompt(i: int, words: int, nonce: str = "") -> str:
    """A prompt of about ``words`` tokens; ``nonce`` first, so that no two drills share a
    cached prefix (a cached prompt would be prefilled where its cache is, not where the
    drill expects)."""
    vocab = ("river", "stone", "light", "north", "quiet", "paper", "green", "cloud", "metal",
             "seven", "bread", "glass", "tiger", "music", "storm", "chair")
    return f"{nonce}Drill {i}: " + " ".join(vocab[(i * 7 + k * 3) % len(vocab)]
                                              for k in range(words))


class Endpoint:
    """The endpoint under drill, through one HTTP client."""

    def __init__(self, url: str, api_key: str | None) -> None:
        import httpx

        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.client = httpx.AsyncClient(base_url=self.url, headers=headers,
                                        timeout=httpx.Timeout(60.0, connect=5.0),
                                        limits=httpx.Limits(max_connections=64))

    async def close(self) -> None:
        await self.client.aclose()

    async def health(self) -> dict[str, Any] | None:
        try:
            r = await self.client.get("/health", timeout=5.0)
            return r.json() if r.status_code == 200 else None
        except Exception:  # not answering: not healthy
            return None

    async def model(self) -> str:
        r = await self.client.get("/v1/models", timeout=10.0)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])

    async def complete(self, body: dict[str, Any], timeout: float) -> tuple[int, str, dict]:
        r = await self.client.post("/v1/completions", json=body, timeout=timeout)
        try:
            data = r.json()
        except ValueError:
            data = {}
        text = data.get("choices", [{}])[0].get("text", "") if r.status_code == 200 else ""
        return r.status_code, text, dict(r.headers)

    async def metrics(self) -> dict[str, float]:
        """Sums over label sets of the families the idle check reads; ``retried``: the
        requests ended with a retryable error so far."""
        from prometheus_client.parser import text_string_to_metric_families

        r = await self.client.get("/metrics", timeout=10.0)
        if r.status_code != 200:
            return {}
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                if s.name in ("tierserve:kv_cache_used_blocks", "tierserve:kv_cache_total_blocks",
                              "tierserve:num_requests_running", "tierserve:num_requests_waiting",
                              "tierserve:num_requests_preempted"):
                    out[s.name] = out.get(s.name, 0.0) + s.value
                    if s.name == "tierserve:kv_cache_total_blocks":
                        out["num_workers_reporting"] = out.get("num_workers_reporting", 0) + 1
                if (s.name == "tierserve:scheduler_decisions_total"
                        and s.labels.get("decision") in ("worker_failed", "transfer_failed")):
                    out["retried"] = out.get("retried", 0.0) + s.value
        return out


class Stream:
    """One streaming completion, read chunk by chunk (started at once)."""

    def max_gap_after(self, t0: float) -> float | None:
        """The longest wait after ``t0`` for the next chunk or the end (None: no end)."""
        if self.t_end is None or not self.task.done():
            return None
        if self.t_end <= t0:
            return 0.0
        marks = [t0, *(t for t in self.chunk_times if t > t0), self.t_end]
        return max(b - a for a, b in zip(marks, marks[1:], strict=False))

    def __init__(self, http: Endpoint, body: dict[str, Any], result: StreamResult) -> None:
        self.http, self.body, self.result = http, body, result
        self.t_end: float | None = None
        self.chunk_times: list[float] = []  # monotonic arrival of each chunk
        self.started = asyncio.Event()  # the first chunk came
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        res = self.result
        parts: list[str] = []
        try:
            async with self.http.client.stream("POST", "/v1/completions", json=self.body,
                                               timeout=WATCH_S + 60) as r:
                res.req_id = r.headers.get("x-tierserve-request-id", "")
                if r.status_code != 200:
                    body = (await r.aread()).decode("utf-8", "replace")
                    res.error = f"HTTP {r.status_code}: {body[:200]}"
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error = str(obj["error"].get("message", obj["error"]))[:200]
                        break
                    for ch in obj.get("choices", []):
                        parts.append(ch.get("text") or "")
                        res.num_chunks += 1
                        self.chunk_times.append(time.monotonic())
                        self.started.set()
                        if ch.get("finish_reason"):
                            res.finish_reason = ch["finish_reason"]
            if res.finish_reason is not None and res.error is None:
                res.completed = True
            elif res.error is None:
                res.error = "the stream ended without a finish reason"
        except Exception as e:  # a broken connection is a clear failure too
            res.error = f"connection lost ({type(e).__name__})"
        finally:
            res.text = "".join(parts)
            self.t_end = time.monotonic()
            self.started.set()


def completion_body(model: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "stream": stream}
    return body


@dataclass(frozen=True, slots=True)
class Probe:
    """One probe request: when it started and ended after the fault, and its answer."""

    start_s: float  # after the fault
    end_s: float
    status: int  # 0: no answer (connection refused or broken, or PROBE_TIMEOUT_S)
    retry_after: bool


async def _probe(http: Endpoint, model: str, t0: float, log: list[Probe]) -> None:
    start = time.monotonic()
    try:
        status, _, headers = await http.complete(completion_body(model, "probe", 2, False),
                                                 PROBE_TIMEOUT_S)
        retry = "retry-after" in {k.lower() for k in headers}
    except Exception:  # no answer at all
        status, retry = 0, False
    log.append(Probe(start - t0, time.monotonic() - t0, status, retry))


async def probe_loop(http: Endpoint, model: str, t0: float, stop: asyncio.Event,
                      log: list[Probe]) -> None:
    """Start a short completion every PROBE_INTERVAL_S, whatever the earlier ones do."""
    tasks = []
    while not stop.is_set():
        tasks.append(asyncio.get_running_loop().create_task(_probe(http, model, t0, log)))
        try:
            await asyncio.wait_for(stop.wait(), PROBE_INTERVAL_S)
        except asyncio.TimeoutError:
            pass
    await asyncio.gather(*tasks)

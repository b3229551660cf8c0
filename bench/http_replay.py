"""Replaying a trace through an OpenAI-compatible endpoint and summing it up per tier: the
library under ``tierserve bench`` (bench.endpoint) and the benches that compare
systems with it (bench.peer, bench.compare, bench.pressure). What is measured and
how is in bench.endpoint's docstring."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler.objective import tier_weights, weighted_miss
from scheduler.tiers import TierConfig, TierSpec

REJECTED_STATUS = 429  # admission said no (router/app.py), counted apart from other errors


@dataclass(slots=True)
class Outcome:
    tier: int
    ok: bool
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    num_tokens: int = 0
    error: str = ""
    # The HTTP status when the server answered with anything but 200 (None otherwise).
    status: int | None = None
    # The server's id for it (tierserve's x-tierserve-request-id header; `tierserve why`).
    req_id: str = ""
    # Seconds from the run's start at which the client sent it and at which it ended
    # (tokens, an error or the client's timeout); None where the driver did not record it.
    sent_s: float | None = None
    end_s: float | None = None

    @property
    def is_rejected(self) -> bool:
        return self.status == REJECTED_STATUS


def slo_met(spec: TierSpec, o: Outcome) -> bool:
    if not o.ok or o.ttft_s is None or o.e2e_s is None:
        return False
    if spec.ttft_s is not None and o.ttft_s > spec.ttft_s:
        return False
    if spec.tpot_s is not None and o.tpot_s is not None and o.tpot_s > spec.tpot_s:
        return False
    return spec.e2e_s is None or o.e2e_s <= spec.e2e_s


def miss_reason(spec: TierSpec, o: Outcome) -> str | None:
    """Why ``o`` missed its tier's target (None: it met it): rejected, error, ttft,
    tpot or e2e, the first that applies."""
    if slo_met(spec, o):
        return None
    if o.is_rejected:
        return "rejected"
    if not o.ok or o.ttft_s is None or o.e2e_s is None:
        return "error"
    if spec.ttft_s is not None and o.ttft_s > spec.ttft_s:
        return "ttft"
    if spec.tpot_s is not None and o.tpot_s is not None and o.tpot_s > spec.tpot_s:
        return "tpot"
    return "e2e"


def _scale(values: np.ndarray, target: int) -> np.ndarray:
    p99 = float(np.percentile(values, 99)) if len(values) else 1.0
    return np.clip(np.rint(values * (target / max(p99, 1.0))), 1, target).astype(int)


async def _one(client: Any, url: str, model: str, prompt: list[int], max_tokens: int, tier: int,
               timeout: float) -> Outcome:
    # The tier travels twice: as vLLM's ``priority`` (0 most urgent) and as our header.
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "priority": tier}
    t0 = time.perf_counter()
    marks: dict[str, float] = {}
    n = 0
    status: int | None = None
    req_id = ""

    async def stream() -> str | None:
        nonlocal n, status, req_id
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers={"x-tierserve-tier": str(tier)}) as r:
            req_id = r.headers.get("x-tierserve-request-id", "")
            if r.status_code != 200:
                status = r.status_code
                text = (await r.aread()).decode(errors="replace")[:200]
                return f"HTTP {r.status_code}: {text}"
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                now = time.perf_counter()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return str(obj["error"].get("message"))
                marks.setdefault("first", now)
                if obj.get("usage"):
                    n = int(obj["usage"]["completion_tokens"])
                elif obj.get("choices"):
                    marks["last"] = now
        return None

    try:
        error = await asyncio.wait_for(stream(), timeout)
    except asyncio.TimeoutError:
        return Outcome(tier, False, error="timeout")
    except Exception as e:  # connection refused / reset: counted as an error, run goes on
        return Outcome(tier, False, error=f"{type(e).__name__}: {e}")
    if error is not None:
        return Outcome(tier, False, error=error, status=status, req_id=req_id)
    first, last = marks.get("first"), marks.get("last", t0)
    if first is None:
        return Outcome(tier, False, error="no tokens")
    tpot = (last - first) / (n - 1) if n > 1 else None
    return Outcome(tier, True, first - t0, tpot, last - t0, n, req_id=req_id)


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def last_end_s(outcomes: list[Outcome]) -> float | None:
    """Seconds from the first request's arrival (sent) to the last one's end, however it
    ended (tokens, an error, a timeout); None unless the driver timed them."""
    sent = [o.sent_s for o in outcomes if o.sent_s is not None]
    ends = [o.end_s for o in outcomes if o.end_s is not None]
    return max(ends) - min(sent) if sent and ends else None


def summarize(outcomes: list[Outcome], tiers: TierConfig, duration_s: float,
              policy: str, url: str) -> dict[str, Any]:
    out: dict[str, Any] = {"policy": policy, "url": url, "requests": len(outcomes),
                           "errors": sum(1 for o in outcomes if not o.ok),
                           "rejected": sum(1 for o in outcomes if o.is_rejected),
                           "duration_s": duration_s, "tiers": {}}
    for t in range(tiers.num_tiers):
        mine = [o for o in outcomes if o.tier == t]
        ok = [o for o in mine if o.ok]
        met = sum(1 for o in mine if slo_met(tiers[t], o))
        ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
        tpot = [o.tpot_s for o in ok if o.tpot_s is not None]
        out["tiers"][str(t)] = {
            "requests": len(mine), "errors": len(mine) - len(ok),
            "rejected": sum(1 for o in mine if o.is_rejected),
            "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
            "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99),
            "attainment": met / len(mine) if mine else None,
            "misses": dict(Counter(r for o in mine if (r := miss_reason(tiers[t], o)))),
            "goodput_rps": met / duration_s if duration_s > 0 else 0.0,
        }
    # The objective (scheduler.objective): attainment above counts a 429, an error and a
    # timeout as a miss of its tier.
    out["weighted_miss"] = weighted_miss({t: s["attainment"] for t, s in out["tiers"].items()},
                                         tier_weights(tiers))
    out["goodput_rps"] = sum(s["goodput_rps"] for s in out["tiers"].values())
    out["last_end_s"] = last_end_s(outcomes)
    return out


def objective_line(summary: dict[str, Any]) -> str:
    """The objective, goodput, last end and work conservation of a summary, in words."""
    wm, last = summary.get("weighted_miss"), summary.get("last_end_s")
    wc = summary.get("work_conservation_s")
    return (f"weighted miss {'-' if wm is None else f'{wm:.3f}'}, goodput "
            f"{summary.get('goodput_rps', 0.0):.2f} req/s, last request ended "
            f"{'-' if last is None else f'{last:.1f} s'} after the first arrival, work "
            f"conservation {'-' if wc is None else f'{sum(wc):.1f} s'}")


WORK_CONSERVATION = "tierserve:work_conservation_seconds_total"
TTFT_PART_FAMILY = "tierserve:ttft_part_seconds"


def parse_work_conservation(text: str) -> list[float] | None:
    """Per tier, ``tierserve:work_conservation_seconds_total`` in a ``/metrics`` answer;
    None where it has no such series (a peer, or a tierserve from before it)."""
    from prometheus_client.parser import text_string_to_metric_families

    by_tier: dict[int, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name == WORK_CONSERVATION and smp.labels.get("tier", "").isdigit():
                    by_tier[int(smp.labels["tier"])] = float(smp.value)
    except ValueError:  # not Prometheus text
        return None
    if not by_tier:
        return None
    return [by_tier.get(t, 0.0) for t in range(max(by_tier) + 1)]


def parse_ttft_parts(text: str) -> dict[str, dict[str, dict[str, Any]]] | None:
    """``tierserve:ttft_part_seconds`` in a ``/metrics`` answer, in the shape of
    ``MetricsRecorder.ttft_parts`` (None where it has no such series: a peer)."""
    from prometheus_client.parser import text_string_to_metric_families

    from router.metrics import hop_histograms

    try:
        samples = [s for fam in text_string_to_metric_families(text)
                   if fam.name == TTFT_PART_FAMILY for s in fam.samples]
    except ValueError:  # not Prometheus text
        return None
    return hop_histograms(samples) or None


async def fetch_counters(client: Any, url: str) -> dict[str, Any]:
    """The endpoint's running totals now, for a delta over one run:
    ``work_conservation_s`` (per tier) and ``ttft_parts`` (the hop histograms); each None
    when not exported (a peer) or when the endpoint did not answer."""
    try:
        r = await client.get(f"{url}/metrics")
    except Exception:  # a bench goes on without the figures
        return {"work_conservation_s": None, "ttft_parts": None}
    text = r.text if r.status_code == 200 else ""
    return {"work_conservation_s": parse_work_conservation(text) if text else None,
            "ttft_parts": parse_ttft_parts(text) if text else None}


async def fetch_work_conservation(client: Any, url: str) -> list[float] | None:
    """The endpoint's per-tier work-conservation totals now (None: not exported, or the
    endpoint did not answer)."""
    return (await fetch_counters(client, url))["work_conservation_s"]


def counters(url: str, api_key: str = "unused", timeout: float = 10.0) -> dict[str, Any]:
    """:func:`fetch_counters` for a caller outside an event loop."""
    import httpx

    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=timeout,
                                     headers={"authorization": f"Bearer {api_key}"}) as c:
            return await fetch_counters(c, url)

    return asyncio.run(go())


def counters_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What one run added to :func:`counters`: ``work_conservation_s`` per tier and
    ``ttft_parts`` per tier and hop (samples, mean, p50, p99 in ms)."""
    from router.metrics import parts_summary

    return {"work_conservation_s": counter_delta(before.get("work_conservation_s"),
                                                 after.get("work_conservation_s")),
            "ttft_parts": parts_summary(before.get("ttft_parts"), after.get("ttft_parts"))}


def hops_line(parts: dict[str, Any] | None, tier: str = "0") -> str:
    """One tier's time-to-first-token hops for a progress line ("" when not measured)."""
    mine = (parts or {}).get(tier)
    if not mine:
        return ""
    from router.metrics import TTFT_PARTS

    cells = [f"{p.replace('_', ' ')} {mine[p]['p50_ms']:.0f}/{mine[p]['p99_ms']:.0f}"
             for p in TTFT_PARTS if p in mine and mine[p].get("p99_ms") is not None]
    return f"tier-{tier} hops p50/p99 ms: " + ", ".join(cells) if cells else ""


def counter_delta(before: list[float] | None, after: list[float] | None) -> list[float] | None:
    """What per-tier counters grew from ``before`` to ``after`` (a counter that went down
    was reset: all of ``after`` is new); None when ``after`` is unknown."""
    if after is None:
        return None
    out = []
    for t, a in enumerate(after):
        b = before[t] if before is not None and t < len(before) else 0.0
        out.append(a - b if a >= b else a)
    return out


async def replay(url: str, trace: str, *, duration: float, load: float, max_prompt: int,
                 max_output: int, max_requests: int, timeout: float, seed: int,
                 api_key: str) -> tuple[list[Outcome], float, str]:
    import httpx

    from scheduler.sim.traces import guess_format, read_trace, scale_load

    # Open loop: no cap on connections. A capped pool would queue requests first come first
    # served in this client, before the scheduler under test could see (and order) them.
    async with httpx.AsyncClient(timeout=timeout, headers={"authorization": f"Bearer {api_key}"},
                                 limits=httpx.Limits(max_connections=None,
                                                     max_keepalive_connections=512)) as client:
        models = (await client.get(f"{url}/v1/models")).json()["data"]
        model, ctx = models[0]["id"], int(models[0].get("max_model_len", 2048))
        reqs = scale_load(read_trace(guess_format(trace), trace, seed=seed), load, duration)
        if max_requests:
            reqs = reqs[:max_requests]
        max_prompt = max_prompt or max(ctx // 8, 16)
        max_output = min(max_output, ctx - max_prompt - 1)
        prompts = _scale(np.array([r.prompt_len for r in reqs], dtype=float), max_prompt)
        outputs = _scale(np.array([r.output_len for r in reqs], dtype=float), max_output)
        rng = np.random.default_rng(seed)
        start = time.perf_counter()

        async def at(i: int) -> Outcome:
            r = reqs[i]
            delay = r.arrival - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = [int(x) for x in rng.integers(32, 127, int(prompts[i]))]
            sent = time.perf_counter() - start
            o = await _one(client, url, model, prompt, int(outputs[i]), r.tier, timeout)
            o.sent_s, o.end_s = sent, time.perf_counter() - start
            return o

        outcomes = await asyncio.gather(*(at(i) for i in range(len(reqs))))
        elapsed = time.perf_counter() - start
    return list(outcomes), elapsed, model

"""``tierserve bench``: replay a trace through a running endpoint over HTTP, per-tier SLOs.

Data flow: trace file (Azure CSV, Mooncake JSONL; ``scheduler.sim.traces`` readers, tiers
from its seeded mix) -> arrivals compressed by ``--load`` and cut at ``--duration`` ->
lengths scaled to the served model's context (prompt and output lengths scaled so the
trace's 99th percentile maps to ``--max-prompt-tokens`` / ``--max-output-tokens``) ->
one streaming ``/v1/completions`` call per request at its arrival time, its tier in the
``x-tierserve-tier`` header -> TTFT (first SSE event), TPOT ((last - first) / (n - 1)),
SLO met per the tier targets -> per-tier P50/P99, attainment, goodput, as text and JSON::

    {"policy", "url", "requests", "errors", "rejected", "duration_s",
     "tiers": {"0": {"requests", "errors", "rejected", "ttft_p50", "ttft_p99", "tpot_p50",
                     "tpot_p99", "attainment", "goodput_rps"}, ...}}

``errors`` counts every request that failed, HTTP 429 included (as before ``rejected``
existed); ``rejected`` is the part of it that admission turned away with a 429.

Bounded: arrivals stop at ``--duration`` and every request has ``--request-timeout``.

``tierserve bench --peer vllm-cpu`` starts tierserve and vLLM here, one after the other,
and replays the same trace through both (``cluster.bench_peer``); ``--url`` is then not
given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.tiers import TierConfig, TierSpec, default_tiers

REJECTED_STATUS = 429  # admission said no (router/app.py), counted apart from other errors


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cluster import bench_peer

    p.add_argument("--url", help="endpoint, e.g. http://127.0.0.1:8000 (required without --peer)")
    p.add_argument("--trace", required=True, help="Azure CSV or Mooncake JSONL trace")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of (scaled) arrivals")
    p.add_argument("--load", type=float, default=None,
                   help="arrival-rate multiplier (default 1; with --peer use --loads)")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the summary here")
    p.add_argument("--policy-label", default="", help="policy name recorded in the JSON")
    p.add_argument("--config", metavar="FILE",
                   help="cluster YAML: tier targets from it (with --peer also tierserve's "
                        "config; default there docs/bench/cpu-tiers.yaml)")
    p.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="prompt length the trace's P99 maps to (0: an eighth of the context)")
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--max-requests", type=int, default=0, help="0: no cap")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default="unused")
    bench_peer.add_arguments(p)


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
            "goodput_rps": met / duration_s if duration_s > 0 else 0.0,
        }
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
            return await _one(client, url, model, prompt, int(outputs[i]), r.tier, timeout)

        outcomes = await asyncio.gather(*(at(i) for i in range(len(reqs))))
        elapsed = time.perf_counter() - start
    return list(outcomes), elapsed, model


def run(args: argparse.Namespace) -> int:
    if args.peer:
        from cluster import bench_peer

        return bench_peer.run(args)
    if not args.url:
        print("tierserve bench: --url is required (or --peer vllm-cpu, which starts tierserve "
              "and the peer here)", file=sys.stderr)
        return 2
    tiers = default_tiers()
    if args.config:
        from cluster.config import ConfigError, load_config

        try:
            tiers = load_config(args.config).tier_config
        except ConfigError as e:
            print(f"tierserve bench: configuration error: {e}", file=sys.stderr)
            return 2
    if not Path(args.trace).exists():
        print(f"tierserve bench: no trace at {args.trace}", file=sys.stderr)
        return 2
    outcomes, elapsed, model = asyncio.run(replay(
        args.url.rstrip("/"), args.trace, duration=args.duration,
        load=1.0 if args.load is None else args.load,
        max_prompt=args.max_prompt_tokens, max_output=args.max_output_tokens,
        max_requests=args.max_requests, timeout=args.request_timeout, seed=args.seed,
        api_key=args.api_key))
    summary = summarize(outcomes, tiers, min(elapsed, args.duration) if elapsed else 0.0,
                        args.policy_label or "unknown", args.url)
    summary["model"] = model
    print(f"{summary['requests']} requests, {summary['errors']} errors "
          f"({summary['rejected']} rejected), {elapsed:.1f} s "
          f"(policy {summary['policy']})")
    print("tier  n     ttft_p50  ttft_p99  tpot_p50  tpot_p99  attain  goodput/s")
    for t, s in summary["tiers"].items():
        def f(x: float | None) -> str:
            return "     -  " if x is None or math.isnan(x) else f"{x:8.3f}"
        print(f"{t:>4}  {s['requests']:<5} {f(s['ttft_p50'])}  {f(s['ttft_p99'])}  "
              f"{f(s['tpot_p50'])}  {f(s['tpot_p99'])}  {f(s['attainment'])} "
              f"{s['goodput_rps']:8.3f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    return 0

"""Prometheus metrics of a tierserve cluster, named ``tierserve:*`` after vLLM's conventions.

Role: one :class:`MetricsRecorder` per process that observes requests (the global
scheduler actor, the router). It owns a private ``CollectorRegistry``, so several
recorders (tests, two apps in one process) never collide, and renders the text
exposition format for ``GET /metrics``.

Data flow::

    transition() -> DecisionRecord ──on_decision(record, tier)──▶ preemption, rejection,
                                                                   decision counters
    request finishes ──on_request_finished(tier, ttft_s, tpot_s, e2e_s, met_slo)──▶
                                                 latency histograms, SLO / goodput counters
    prefill done ──on_ttft_parts(tier, {queued, handoff, step_wait, prefill})──▶ hop histograms
    kvtransfer done ──on_transfer(topology_class, num_bytes, seconds)──▶ transfer figures
    periodic snapshot ──set_queue_depth / set_request_counts / set_kv_usage / set_shares
                        / on_prefix_lookup──▶ gauges and prefix-cache counters
                        / set_work_conservation──▶ the work-conservation counter
    GET /metrics ──render() -> bytes (CONTENT_TYPE)

API (all methods are cheap, synchronous and thread-safe through prometheus-client):

- ``MetricsRecorder(tiers: TierConfig | None = None)``; with ``tiers`` given,
  ``on_request_finished`` may leave ``met_slo=None`` and the recorder judges the SLO
  with :func:`slo_met`.
- ``on_decision(record, tier)``: every ``scheduler.request.DecisionRecord``; counts all
  decisions, preemptions by reason (``triggered_by`` less per-entity detail, see
  :func:`reason_label`) and mode
  (swap / recompute / migrate, labelled with the victim's tier) and admission rejections.
- ``on_request_finished(tier, ttft_s, tpot_s, e2e_s, met_slo=None, *, num_prompt_tokens=0,
  num_output_tokens=0, finished_reason="stop", queue_s=None)``: ``tpot_s`` is ``None`` for a
  single-token answer; ``queue_s`` is the time spent QUEUED before the first prefill.
- ``on_admission_rejected(tier, reason)``: a rejection that produced no DecisionRecord.
- ``on_ttft_parts(tier, parts)``: one prefill's time to first token split into its hops
  (``TTFT_PARTS``: the global queue, the hand-off to the prefill worker, the wait there for
  the step that runs its first chunk, the prefill itself); ``ttft_parts()`` reads the
  histograms back as plain types and :func:`parts_summary` turns two such readings into
  per-tier, per-hop samples, mean, p50 and p99 (what the benches report).
- ``on_transfer(topology_class, num_bytes, seconds)``: class as a string or an enum with
  ``.value`` (``same_device`` / ``same_domain`` / ``same_node`` / ``cross_node``).
- ``on_prefix_lookup(num_queried_blocks, num_hit_blocks)``: hit rate =
  ``rate(tierserve:prefix_cache_hits_total) / rate(tierserve:prefix_cache_queries_total)``.
- ``set_queue_depth(tier, n)``, ``set_request_counts(tier, *, running, preempted, swapped)``,
  ``set_kv_usage(worker_id, used_blocks, total_blocks)``, ``set_shares(shares)``,
  ``set_kv_memory(worker_id, swap_used, swap_peak, prefix_query_blocks,
  prefix_hit_blocks)`` (swapped blocks and the prefix hit rate per worker),
  ``set_work_conservation(seconds_by_tier)`` (the kernel's running totals per tier of
  ``ClusterScheduler.work_conservation_s``; ``tierserve:work_conservation_seconds_total``
  moves by what each grew).
- ``render() -> bytes`` and the module constant ``CONTENT_TYPE`` for the HTTP response.

Several processes: each renders its own registry; the expositions of recorders that
record different metrics may be concatenated into one ``/metrics`` answer. Two that
record the same metric must not be (Prometheus would see duplicate series): keep the
request-level metrics in exactly one process, the global scheduler.

``METRIC_NAMES`` lists every sample family this module exposes (histogram and counter
families under their base names), for dashboards and their tests.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from scheduler.request import Decision, DecisionRecord
from scheduler.tiers import TierConfig, TierSpec

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "tierserve:"

# Buckets follow vLLM's (seconds), so dashboards written for it read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# The hops of a time to first token (``on_ttft_parts``): finer below the 200 ms of a chat tier.
PART_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25,
                0.35, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
# queued: arrival -> dispatch (the global queue); handoff: dispatch -> the prefill worker
# has it (RPCs, the decode worker's reservation); step_wait: -> the step that runs its first
# chunk begins (the wait for a running step); prefill: -> its first token is sampled.
TTFT_PARTS = ("queued", "handoff", "step_wait", "prefill")
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)

_PREEMPT_MODES = {
    Decision.PREEMPT_SWAP: "swap",
    Decision.PREEMPT_RECOMPUTE: "recompute",
    Decision.PREEMPT_MIGRATE: "migrate",
}
# Bounds label values taken from free text (triggered_by) so a bug cannot explode series.
_MAX_LABEL_LEN = 64


def reason_label(triggered_by: str) -> str:
    """The reason without per-entity detail, so label values stay few.

    ``triggered_by`` reads ``reason[:detail...]``; segments after the first are kept up
    to the first that names an entity (has a digit): ``"kv_full:decode-1"`` ->
    ``"kv_full"``, ``"admission:no_kv"`` -> ``"admission:no_kv"``.
    """
    parts = [p.strip() for p in triggered_by.split(":")]
    kept = parts[:1]
    for p in parts[1:]:
        if not p or any(c.isdigit() for c in p):
            break
        kept.append(p)
    return ":".join(kept)[:_MAX_LABEL_LEN] or "unknown"


def _label(value: object) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    return str(value)[:_MAX_LABEL_LEN]


def slo_met(spec: TierSpec, ttft_s: float | None, tpot_s: float | None, e2e_s: float) -> bool:
    """Did a finished request meet every target its tier sets?

    A missing TTFT (the request produced no token) misses a TTFT target; a missing
    TPOT (one output token) cannot miss a TPOT target.
    """
    if spec.ttft_s is not None and (ttft_s is None or ttft_s > spec.ttft_s):
        return False
    if spec.tpot_s is not None and tpot_s is not None and tpot_s > spec.tpot_s:
        return False
    return not (spec.e2e_s is not None and e2e_s > spec.e2e_s)


class MetricsRecorder:
    """Owns a private registry with every tierserve metric; see the module docstring."""

    def __init__(self, tiers: TierConfig | None = None) -> None:
        self.tiers = tiers
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = PREFIX
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token, per tier.",
                              ["tier"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per tier.",
                              ["tier"], buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end latency, per tier.",
                             ["tier"], buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds",
                                    "Time spent queued before the first prefill, per tier.",
                                    ["tier"], buckets=TTFT_BUCKETS, registry=r)
        self.finished = Counter(p + "request_success", "Finished requests by tier and reason.",
                                ["tier", "finished_reason"], registry=r)
        self.slo_met_total = Counter(p + "slo_met", "Finished requests that met every target "
                                     "of their tier (goodput in requests).", ["tier"], registry=r)
        self.slo_missed_total = Counter(p + "slo_missed", "Finished requests that missed a "
                                        "target of their tier.", ["tier"], registry=r)
        self.goodput_tokens = Counter(p + "goodput_tokens", "Output tokens of requests that met "
                                      "their SLO.", ["tier"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests.",
                                     ["tier"], registry=r)
        self.generation_tokens = Counter(p + "generation_tokens",
                                         "Output tokens of finished requests.", ["tier"],
                                         registry=r)
        self.decisions = Counter(p + "scheduler_decisions", "Request state changes by decision.",
                                 ["tier", "decision"], registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Preemptions by tier of the victim, "
                                   "reason and mode.", ["tier", "reason", "mode"], registry=r)
        self.rejections = Counter(p + "admission_rejections", "Requests refused by admission.",
                                  ["tier", "reason"], registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt blocks looked up in a "
                                      "prefix cache.", registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt blocks served from a prefix "
                                   "cache.", registry=r)
        self.transfer_bytes = Counter(p + "kv_transfer_bytes", "KV bytes moved between workers, "
                                      "by topology class.", ["topology"], registry=r)
        self.transfer_seconds = Histogram(p + "kv_transfer_seconds", "Duration of one request's "
                                          "KV transfer, by topology class.", ["topology"],
                                          buckets=TRANSFER_BUCKETS, registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued, per tier.", ["tier"],
                             registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests holding KV and making "
                             "progress, per tier.", ["tier"], registry=r)
        self.preempted = Gauge(p + "num_requests_preempted", "Requests preempted and not yet "
                               "resumed, per tier.", ["tier"], registry=r)
        self.swapped = Gauge(p + "num_requests_swapped", "Preempted requests whose KV sits in "
                             "CPU memory, per tier.", ["tier"], registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of a worker's KV blocks in "
                              "use (0 to 1).", ["worker_id"], registry=r)
        self.kv_used_blocks = Gauge(p + "kv_cache_used_blocks", "KV blocks in use, per worker.",
                                    ["worker_id"], registry=r)
        self.kv_total_blocks = Gauge(p + "kv_cache_total_blocks", "KV block budget, per worker.",
                                     ["worker_id"], registry=r)
        self.shares = Gauge(p + "tier_share", "Current fair-share value of each tier (sums to 1).",
                            ["tier"], registry=r)
        self.swap_used_blocks = Gauge(p + "kv_swap_used_blocks", "KV blocks in a worker's host "
                                      "swap space now.", ["worker_id"], registry=r)
        self.swap_peak_blocks = Gauge(p + "kv_swap_peak_blocks", "Most KV blocks a worker's host "
                                      "swap space held at once.", ["worker_id"], registry=r)
        self.work_conservation = Counter(p + "work_conservation_seconds", "Seconds past one "
                                         "planning interval that a waiting request of this "
                                         "tier fitted a decode worker and was not placed.",
                                         ["tier"], registry=r)
        self._work_conservation_seen: dict[str, float] = {}
        self.ttft_part = Histogram(p + "ttft_part_seconds", "A time to first token split into "
                                   "its hops (part: " + ", ".join(TTFT_PARTS) + "), per tier.",
                                   ["tier", "part"], buckets=PART_BUCKETS, registry=r)
        self.worker_prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate", "Share of the prompt "
                                            "blocks a worker looked up in its prefix cache that "
                                            "were hits (since it started).", ["worker_id"],
                                            registry=r)

    # -- events --------------------------------------------------------------------------

    def on_decision(self, record: DecisionRecord, tier: int) -> None:
        t = str(tier)
        self.decisions.labels(t, record.decision.value).inc()
        mode = _PREEMPT_MODES.get(record.decision)
        if mode is not None:
            self.preemptions.labels(t, reason_label(record.triggered_by), mode).inc()
        elif record.decision is Decision.REJECT:
            self.rejections.labels(t, reason_label(record.triggered_by)).inc()

    def on_admission_rejected(self, tier: int, reason: str) -> None:
        self.rejections.labels(str(tier), reason_label(reason)).inc()

    def on_request_finished(
        self,
        tier: int,
        ttft_s: float | None,
        tpot_s: float | None,
        e2e_s: float,
        met_slo: bool | None = None,
        *,
        num_prompt_tokens: int = 0,
        num_output_tokens: int = 0,
        finished_reason: str = "stop",
        queue_s: float | None = None,
    ) -> bool:
        """Record one finished request; returns whether it met its SLO."""
        for name, v in (("ttft_s", ttft_s), ("tpot_s", tpot_s), ("e2e_s", e2e_s),
                        ("queue_s", queue_s)):
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"on_request_finished: {name} must be >= 0 seconds, got {v}")
        if met_slo is None:
            if self.tiers is None:
                raise ValueError("on_request_finished: met_slo is required without a TierConfig")
            if not 0 <= tier < self.tiers.num_tiers:
                raise ValueError(f"on_request_finished: tier {tier} is not configured")
            met_slo = slo_met(self.tiers[tier], ttft_s, tpot_s, e2e_s)
        t = str(tier)
        if ttft_s is not None:
            self.ttft.labels(t).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.labels(t).observe(tpot_s)
        self.e2e.labels(t).observe(e2e_s)
        if queue_s is not None:
            self.queue_time.labels(t).observe(queue_s)
        self.finished.labels(t, _label(finished_reason)).inc()
        self.prompt_tokens.labels(t).inc(num_prompt_tokens)
        self.generation_tokens.labels(t).inc(num_output_tokens)
        if met_slo:
            self.slo_met_total.labels(t).inc()
            self.goodput_tokens.labels(t).inc(num_output_tokens)
        else:
            self.slo_missed_total.labels(t).inc()
        return met_slo

    def on_transfer(self, topology_class: object, num_bytes: int, seconds: float) -> None:
        if num_bytes < 0 or not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"on_transfer: bad figures bytes={num_bytes} seconds={seconds}")
        cls = _label(topology_class)
        self.transfer_bytes.labels(cls).inc(num_bytes)
        self.transfer_seconds.labels(cls).observe(seconds)

    def on_ttft_parts(self, tier: int, parts: Mapping[str, float]) -> None:
        """One prefill's time to first token, hop by hop (names from ``TTFT_PARTS``)."""
        for name, v in parts.items():
            if name not in TTFT_PARTS or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"on_ttft_parts: bad part {name}={v}")
        t = str(tier)
        for name, v in parts.items():
            self.ttft_part.labels(t, name).observe(v)

    def ttft_parts(self) -> dict[str, dict[str, dict[str, object]]]:
        """The hop histograms now, per tier and part: ``{"sum", "count", "buckets":
        [[upper bound, cumulative count], ...]}`` (plain types; :func:`parts_summary`
        reads two of these)."""
        return hop_histograms(s for fam in self.ttft_part.collect() for s in fam.samples)

    def on_prefix_lookup(self, num_queried_blocks: int, num_hit_blocks: int) -> None:
        if not 0 <= num_hit_blocks <= num_queried_blocks:
            raise ValueError(f"on_prefix_lookup: {num_hit_blocks} hits of {num_queried_blocks}")
        self.prefix_queries.inc(num_queried_blocks)
        self.prefix_hits.inc(num_hit_blocks)

    # -- snapshots -----------------------------------------------------------------------

    def set_queue_depth(self, tier: int, n: int) -> None:
        self.waiting.labels(str(tier)).set(n)

    def set_request_counts(self, tier: int, *, running: int, preempted: int, swapped: int) -> None:
        t = str(tier)
        self.running.labels(t).set(running)
        self.preempted.labels(t).set(preempted)
        self.swapped.labels(t).set(swapped)

    def set_kv_usage(self, worker_id: str, used_blocks: int, total_blocks: int) -> None:
        if total_blocks <= 0 or not 0 <= used_blocks <= total_blocks:
            raise ValueError(f"set_kv_usage({worker_id}): {used_blocks} used of {total_blocks}")
        w = _label(worker_id)
        self.kv_usage.labels(w).set(used_blocks / total_blocks)
        self.kv_used_blocks.labels(w).set(used_blocks)
        self.kv_total_blocks.labels(w).set(total_blocks)

    def set_kv_memory(self, worker_id: str, swap_used: int, swap_peak: int,
                      prefix_query_blocks: int, prefix_hit_blocks: int) -> None:
        """A worker's swap space and prefix cache (cumulative lookups and hits)."""
        w = _label(worker_id)
        self.swap_used_blocks.labels(w).set(swap_used)
        self.swap_peak_blocks.labels(w).set(swap_peak)
        if prefix_query_blocks > 0:
            self.worker_prefix_hit_rate.labels(w).set(prefix_hit_blocks / prefix_query_blocks)

    def forget_worker(self, worker_id: str) -> None:
        """Drop a dead worker's KV series: its blocks died with it (a replacement under
        the same id sets them again when it reports)."""
        w = _label(worker_id)
        for gauge in (self.kv_usage, self.kv_used_blocks, self.kv_total_blocks,
                      self.swap_used_blocks, self.swap_peak_blocks, self.worker_prefix_hit_rate):
            try:
                gauge.remove(w)
            except KeyError:  # never reported
                pass

    def set_work_conservation(self, seconds_by_tier: Sequence[float]) -> None:
        """The kernel's running totals per tier (``ClusterScheduler.work_conservation_s``):
        the counter moves by what each grew since the last call (a total that went down,
        a restarted kernel's, starts counting again from there)."""
        for tier, total in enumerate(seconds_by_tier):
            if not (math.isfinite(total) and total >= 0):
                raise ValueError(f"set_work_conservation: tier {tier} total {total} is not "
                                 ">= 0 seconds")
            t = str(tier)
            seen = self._work_conservation_seen.get(t, 0.0)
            self.work_conservation.labels(t).inc(total - seen if total >= seen else total)
            self._work_conservation_seen[t] = total

    def set_shares(self, shares: Sequence[float] | Mapping[int, float]) -> None:
        items = shares.items() if isinstance(shares, Mapping) else enumerate(shares)
        for tier, share in items:
            if not (math.isfinite(share) and 0.0 <= share <= 1.0):
                raise ValueError(f"set_shares: tier {tier} share {share} is not in [0, 1]")
            self.shares.labels(str(tier)).set(share)

    # -- exposition ----------------------------------------------------------------------

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format (serve with CONTENT_TYPE)."""
        return generate_latest(self.registry)


def hop_histograms(samples: Iterable[Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """The samples of ``tierserve:ttft_part_seconds`` (from a registry, or parsed from a
    ``/metrics`` answer: both have ``name``, ``labels`` and ``value``) as
    :meth:`MetricsRecorder.ttft_parts` gives them."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for smp in samples:
        h = out.setdefault(smp.labels.get("tier", ""), {}).setdefault(
            smp.labels.get("part", ""), {"sum": 0.0, "count": 0, "buckets": []})
        if smp.name.endswith("_bucket"):
            le = float(smp.labels["le"])
            if math.isfinite(le):
                h["buckets"].append([le, int(smp.value)])
        elif smp.name.endswith("_sum"):
            h["sum"] = float(smp.value)
        elif smp.name.endswith("_count"):
            h["count"] = int(smp.value)
    return out


def histogram_quantile(q: float, buckets: Sequence[Sequence[float]], count: int) -> float | None:
    """Prometheus' ``histogram_quantile``: the ``q`` quantile from cumulative buckets
    ``[[upper bound, count], ...]`` (ascending, +Inf left out; ``count`` all samples),
    linear within the bucket; past the last finite bound, that bound. None: no samples."""
    if count <= 0:
        return None
    rank = q * count
    lo, below = 0.0, 0
    for le, cum in buckets:
        if cum >= rank:
            inside = cum - below
            return le if inside <= 0 else lo + (le - lo) * (rank - below) / inside
        lo, below = le, cum
    return lo


def parts_summary(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None
                  ) -> dict[str, dict[str, dict[str, float | int | None]]] | None:
    """What the hop histograms (:meth:`MetricsRecorder.ttft_parts`) gained from ``before``
    to ``after``, per tier and part: samples, mean, p50 and p99 in ms (a histogram that
    went down was reset: all of ``after`` is new). None when ``after`` is unknown."""
    if after is None:
        return None
    out: dict[str, dict[str, dict[str, float | int | None]]] = {}
    for tier, parts in after.items():
        for part, h in parts.items():
            b = ((before or {}).get(tier) or {}).get(part)
            if b is not None and int(b["count"]) > int(h["count"]):
                b = None
            n = int(h["count"]) - (int(b["count"]) if b else 0)
            total = float(h["sum"]) - (float(b["sum"]) if b else 0.0)
            old = {le: c for le, c in b["buckets"]} if b else {}
            cum = [[le, c - old.get(le, 0)] for le, c in h["buckets"]]
            q50, q99 = histogram_quantile(0.5, cum, n), histogram_quantile(0.99, cum, n)
            out.setdefault(tier, {})[part] = {
                "n": n, "mean_ms": round(1e3 * total / n, 2) if n else None,
                "p50_ms": None if q50 is None else round(1e3 * q50, 2),
                "p99_ms": None if q99 is None else round(1e3 * q99, 2)}
    return out


def _family_names() -> frozenset[str]:
    rec = MetricsRecorder()
    return frozenset(m.name for m in rec.registry.collect())


# Base family names ("tierserve:num_preemptions", not "..._total"); see the docstring.
METRIC_NAMES: frozenset[str] = _family_names()

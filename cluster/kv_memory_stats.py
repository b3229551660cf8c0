"""The cluster's KV memory decisions as figures: preemptions by mode, restore times by
mode and topology class, the swap spaces, the prefix caches, the link model.

The global scheduler feeds one :class:`KVMemoryStats` with every decision record (the
kernel's observer hook) and with each worker's ``KVMemoryReport``; ``snapshot()`` is what
``stats()["kv_memory"]`` shows and what ``tierserve bench-pressure`` reads. Plain
Python, no Ray.

- preemptions: PREEMPT_SWAP / PREEMPT_RECOMPUTE / PREEMPT_MIGRATE decisions, whoever
  ordered them (the kernel for an arrival, or a worker's own KV pressure).
- restore_s: how long bringing a victim's KV back took, as the worker that did it timed
  it (swap: the copy in; recompute: first recompute chunk to its next token; migrate:
  the target's reservation to decoding there), by mode and by the class of the link the
  blocks came over (``host`` for a swap, ``same_device`` for a recompute in place, the
  two workers' topology class for a migration).
- paused_s: from a victim's preemption to its next decode step, by mode (the restore
  plus the wait for room).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from typing import Any

from scheduler.messages import KVMemoryReport, PreemptMode
from scheduler.request import Decision, DecisionRecord

_PREEMPT = {Decision.PREEMPT_SWAP: "swap", Decision.PREEMPT_RECOMPUTE: "recompute",
            Decision.PREEMPT_MIGRATE: "migrate"}
_RESUME = {Decision.RESUME_SWAP_IN: "swap", Decision.RESUME_RECOMPUTE: "recompute",
           Decision.RESUME_MIGRATE: "migrate"}
MODES = ("swap", "recompute", "migrate")
# Samples kept per series (the oldest go first): enough for a bench's percentiles.
MAX_SAMPLES = 20000
# Restores listed one by one in the snapshot (the latest).
RECENT = 32


def summary(xs: list[float]) -> dict[str, float]:
    """Count, mean, p50, p99 and max of ``xs``, in milliseconds (empty: count 0)."""
    if not xs:
        return {"count": 0}
    s = sorted(xs)
    return {"count": len(s), "mean_ms": 1e3 * statistics.fmean(s),
            "p50_ms": 1e3 * s[len(s) // 2], "p99_ms": 1e3 * s[min(len(s) - 1, int(0.99 * len(s)))],
            "max_ms": 1e3 * s[-1]}


class KVMemoryStats:
    def __init__(self) -> None:
        self.preemptions = {m: 0 for m in MODES}
        self.restore_s: dict[tuple[str, str], list[float]] = {}
        self.paused_s: dict[str, list[float]] = {m: [] for m in MODES}
        self._since: dict[str, tuple[str, float]] = {}  # victim -> (mode, preempted at)
        self.memory: dict[str, KVMemoryReport] = {}
        # The latest restores one by one: (request, mode, class, ms, cached tokens).
        self.recent: deque[tuple[str, str, str, float, int]] = deque(maxlen=RECENT)

    def on_decision(self, rec: DecisionRecord) -> None:
        mode = _PREEMPT.get(rec.decision)
        if mode is not None:
            self.preemptions[mode] += 1
            self._since[rec.req_id] = (mode, rec.time)
            return
        mode = _RESUME.get(rec.decision)
        if mode is not None and rec.req_id in self._since:
            _, t = self._since.pop(rec.req_id)
            _push(self.paused_s[mode], rec.time - t)
        elif rec.to_state.is_finished:
            self._since.pop(rec.req_id, None)

    def on_memory(self, worker_id: str, mem: KVMemoryReport,
                  move_class: Callable[[str], str | None]) -> None:
        """A worker's report; ``move_class(from_worker_id)``: the topology class of a
        migration from that worker to this one (None: unknown worker)."""
        self.memory[worker_id] = mem
        for r in mem.restores:
            mode = r.mode.value
            cls = ("host" if r.mode is PreemptMode.SWAP else "same_device"
                   if r.mode is PreemptMode.RECOMPUTE
                   else move_class(r.from_worker_id) or "unknown")
            _push(self.restore_s.setdefault((mode, cls), []), r.seconds)
            self.recent.append((r.req_id, mode, cls, 1e3 * r.seconds, r.num_cached_tokens))

    def forget_worker(self, worker_id: str) -> None:
        self.memory.pop(worker_id, None)

    def snapshot(self, links: dict[str, Any] | None = None) -> dict[str, Any]:
        by_mode: dict[str, list[float]] = {m: [] for m in MODES}
        by_class: dict[str, dict[str, Any]] = {m: {} for m in MODES}
        for (mode, cls), xs in self.restore_s.items():
            by_mode.setdefault(mode, []).extend(xs)
            by_class.setdefault(mode, {})[cls] = summary(xs)
        workers = {}
        for wid, m in self.memory.items():
            q = m.num_prefix_query_blocks
            workers[wid] = {"swap_blocks": m.num_swap_blocks, "swap_used": m.num_swap_used,
                            "swap_peak": m.num_swap_peak, "prefix_query_blocks": q,
                            "prefix_hit_blocks": m.num_prefix_hit_blocks,
                            "prefix_hit_rate": m.num_prefix_hit_blocks / q if q else None}
        return {"preemptions": dict(self.preemptions),
                "restore": {m: summary(xs) for m, xs in by_mode.items()},
                "restore_by_class": by_class,
                "paused": {m: summary(xs) for m, xs in self.paused_s.items()},
                "workers": workers, "links": links or {},
                "recent_restores": [list(r) for r in self.recent]}


def _push(xs: list[float], x: float) -> None:
    xs.append(x)
    if len(xs) > MAX_SAMPLES:
        del xs[: len(xs) - MAX_SAMPLES]

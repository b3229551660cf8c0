"""Placement: which prefill worker and which decode worker serve a request.

Prefill: the worker with the earliest predicted finish, where the prediction is
its queued work (``backlog_s``) plus this prompt's prefill minus the blocks it
already holds (prefix match length from the per-worker block-hash index, see
:class:`scheduler.prefix_index.PrefixMirror`). A long prefix hit on a busy
worker can beat an idle worker that must compute everything.

Decode: a worker with room for the request's blocks, most headroom first,
preferring the prefill worker's NVLink domain (then node, then anything) as long
as the preferred worker keeps ``min_headroom`` of its blocks free after the
reservation. The move's topology class and cost go into the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.deadlines import ServiceEstimate
from scheduler.links import LinkPricer
from scheduler.topology import TopologyClass, WorkerInfo, topology_class

_RANK = {TopologyClass.SAME_DEVICE: 0, TopologyClass.SAME_DOMAIN: 1,
         TopologyClass.SAME_NODE: 2, TopologyClass.CROSS_NODE: 3}


@dataclass(frozen=True, slots=True)
class PrefillView:
    info: WorkerInfo
    backlog_s: float
    match_blocks: int = 0
    # Queued work per tier (s); empty when the worker does not report it.
    backlog_by_tier: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class DecodeView:
    info: WorkerInfo
    num_free_blocks: int
    num_running: int = 0
    # Blocks per second its finishing decodes give back (None: none running, or unknown),
    # per tier t the blocks its requests of tiers up to t add within an anti-thrash window
    # at its measured step time (empty: none), and how many decode workers share the
    # arrivals: what a policy's measured reserve reads (scheduler.reserves).
    release_blocks_per_s: float | None = None
    growth_blocks: tuple[int, ...] = ()
    num_workers: int = 1


@dataclass(frozen=True, slots=True)
class DecodeChoice:
    view: DecodeView
    move_class: TopologyClass
    move_s: float


def choose_prefill(prompt_len: int, block_size: int, views: Sequence[PrefillView],
                   est: ServiceEstimate, ahead_tiers: int | None = None) -> PrefillView | None:
    """``ahead_tiers``: count only the queued work of tiers below it (the work that
    runs before this request), when the views report work per tier."""
    best: PrefillView | None = None
    best_t = float("inf")
    for v in views:
        hit = min(v.match_blocks * block_size, max(prompt_len - 1, 0))
        ahead = (sum(v.backlog_by_tier[:ahead_tiers])
                 if ahead_tiers is not None and v.backlog_by_tier else v.backlog_s)
        t = ahead + est.prefill_s(prompt_len - hit, hit)
        if t < best_t:
            best, best_t = v, t
    return best


def choose_decode(need_blocks: int, views: Sequence[DecodeView], prefill: WorkerInfo,
                  costs: LinkPricer | None = None, min_headroom: float = 0.1) -> DecodeChoice | None:
    best: tuple[tuple[int, float], DecodeView, TopologyClass] | None = None
    for v in views:
        if v.num_free_blocks < need_blocks:
            continue
        cls = topology_class(prefill, v.info)
        headroom = (v.num_free_blocks - need_blocks) / v.info.num_kv_blocks
        rank = _RANK[cls] if headroom >= min_headroom else _RANK[cls] + 4
        key = (rank, -headroom)
        if best is None or key < best[0]:
            best = (key, v, cls)
    if best is None:
        return None
    _, view, cls = best
    move = costs.move_s(need_blocks, cls) if costs is not None else 0.0
    return DecodeChoice(view, cls, move)

"""Preemption: which running requests give up their blocks, and how (DESIGN §6-7).

The caller needs ``need_blocks`` on one worker for a request of tier
``requester_tier``. Candidates are the worker's running requests of a lower tier
(a larger tier number) that were not preempted within ``anti_thrash_s``. Each is
priced by a named scorer:

- ``design-notes``: score = mem / (progress + eps) x reuse_value; a high score
  is a good victim (much memory, little progress lost, blocks that survive as a
  prefix elsewhere). Its cost is 1 / score.
- ``topology`` (default): cost = tier weight x restore cost, where restore cost
  is the least of swap-in over PCIe, recompute (a prefill of its whole
  context), or a copy from a peer in the same NVLink domain (the victim migrates
  there now and its blocks come back over NVLink, or it simply continues there).
  The cheapest restore path is also the victim's mode: SWAP, RECOMPUTE or MIGRATE.

Victim choice is a greedy knapsack, not an LP: sort by cost per freed block and
take victims until the need is covered, then drop any victim the others already
cover (most expensive first). Preempting is 0/1 per request, so an LP relaxation
returns fractions that must be rounded anyway, and an exact 0/1 solve is
NP-hard; the greedy density order is within one item of the LP optimum, runs in
O(n log n) for the few hundred running requests a worker has, and keeps the
decision inside the per-step latency budget.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.deadlines import ServiceEstimate
from scheduler.request import Request
from scheduler.tiers import TierConfig
from scheduler.topology import LinkCosts, TopologyClass, WorkerInfo

EPS = 1e-3


class PreemptMode(enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"
    MIGRATE = "migrate"


class VictimScorer(enum.Enum):
    DESIGN_NOTES = "design-notes"
    TOPOLOGY = "topology"


@dataclass(frozen=True, slots=True)
class VictimView:
    req: Request
    worker: WorkerInfo
    num_blocks: int
    # Blocks of this request also cached elsewhere (they survive its preemption).
    num_shared_blocks: int = 0
    # A worker in the victim's NVLink domain with room for its blocks, if any.
    peer: WorkerInfo | None = None


@dataclass(frozen=True, slots=True)
class Victim:
    req_id: str
    mode: PreemptMode
    num_blocks: int
    cost: float
    peer_id: str | None = None


@dataclass(frozen=True, slots=True)
class PreemptionPlan:
    victims: tuple[Victim, ...]
    num_freed: int

    def covers(self, need_blocks: int) -> bool:
        return self.num_freed >= need_blocks


def is_eligible(req: Request, requester_tier: int, now: float, anti_thrash_s: float) -> bool:
    if req.tier <= requester_tier:
        return False
    return req.last_preempt_time is None or now - req.last_preempt_time >= anti_thrash_s


def restore_options(v: VictimView, costs: LinkCosts, est: ServiceEstimate,
                    modes: frozenset[PreemptMode]) -> dict[PreemptMode, float]:
    out: dict[PreemptMode, float] = {}
    if PreemptMode.SWAP in modes:
        out[PreemptMode.SWAP] = costs.swap_s(v.num_blocks)
    if PreemptMode.RECOMPUTE in modes:
        ctx = max(v.req.num_context_tokens, 1)
        # Blocks still cached as a prefix elsewhere need no recompute.
        shared = min(ctx - 1, v.num_shared_blocks * ctx // max(v.num_blocks, 1))
        out[PreemptMode.RECOMPUTE] = est.prefill_s(ctx - shared, shared)
    if PreemptMode.MIGRATE in modes and v.peer is not None:
        cls = (TopologyClass.SAME_DOMAIN if v.peer.domain == v.worker.domain
               else TopologyClass.SAME_NODE if v.peer.node == v.worker.node
               else TopologyClass.CROSS_NODE)
        out[PreemptMode.MIGRATE] = costs.move_s(v.num_blocks, cls)
    return out


def price(v: VictimView, scorer: VictimScorer, tiers: TierConfig, costs: LinkCosts,
          est: ServiceEstimate, modes: frozenset[PreemptMode]) -> tuple[float, PreemptMode]:
    opts = restore_options(v, costs, est, modes)
    if not opts:
        raise ValueError("modes: no restore path available for a victim")
    mode = min(opts, key=lambda m: opts[m])
    if scorer is VictimScorer.TOPOLOGY:
        return tiers[v.req.tier].weight * opts[mode], mode
    progress = v.req.num_output_tokens / max(v.req.max_new_tokens, 1)
    reuse_value = 1.0 + v.num_shared_blocks / max(v.num_blocks, 1)
    score = v.num_blocks / (progress + EPS) * reuse_value
    return 1.0 / score, mode


def choose_victims(need_blocks: int, candidates: Sequence[VictimView], *, requester_tier: int,
                   now: float, tiers: TierConfig, costs: LinkCosts, est: ServiceEstimate,
                   scorer: VictimScorer = VictimScorer.TOPOLOGY,
                   modes: frozenset[PreemptMode] = frozenset(PreemptMode)) -> PreemptionPlan:
    """Cheapest set of eligible victims freeing ``need_blocks`` (or all it can)."""
    if need_blocks <= 0:
        return PreemptionPlan((), 0)
    priced: list[tuple[float, Victim]] = []
    for v in candidates:
        if v.num_blocks <= 0 or not is_eligible(v.req, requester_tier, now, tiers.anti_thrash_s):
            continue
        cost, mode = price(v, scorer, tiers, costs, est, modes)
        peer = v.peer.worker_id if mode is PreemptMode.MIGRATE and v.peer else None
        priced.append((cost / v.num_blocks, Victim(v.req.req_id, mode, v.num_blocks, cost, peer)))
    priced.sort(key=lambda cv: cv[0])
    chosen: list[Victim] = []
    freed = 0
    for _, victim in priced:
        if freed >= need_blocks:
            break
        chosen.append(victim)
        freed += victim.num_blocks
    if freed >= need_blocks:
        for victim in sorted(chosen, key=lambda x: -x.cost):
            if freed - victim.num_blocks >= need_blocks:
                chosen.remove(victim)
                freed -= victim.num_blocks
    return PreemptionPlan(tuple(chosen), freed)

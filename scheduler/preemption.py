"""Preemption: which running requests give up their blocks, and how (DESIGN §6-7).

The caller needs ``need_blocks`` on one worker for a request of tier
``requester_tier``. Candidates are the worker's running requests of a lower tier
(a larger tier number) that were not preempted within ``anti_thrash_s``. Each is
priced by a named scorer:

- ``design-notes``: score = mem / (progress + eps) x reuse_value; a high score
  is a good victim (much memory, little progress lost, blocks that survive as a
  prefix elsewhere). Its cost is 1 / score.
- ``topology`` (default): cost = tier weight x restore cost x (1 + restore cost / the
  slack to its own target left after the restore, at least ``SLACK_FLOOR_S``): the
  restore's work at the tier's weight (it takes capacity every request on the worker
  shares), raised by the risk that it makes the victim late, so of two victims with the
  same restore the one with more slack goes first, and one the restore would make late
  costs most (issue 22: a batch request with minutes to spare, not one whose deadline is
  near); restore cost
  is the least of: swap-in over the host link (only while its worker's swap space
  has room for it), recompute (a prefill of its context, less the blocks another
  request keeps cached there), or a move to a peer decode worker with room (it
  migrates there and decodes on; priced by the link of the two workers' topology
  class, less the blocks the peer already caches). Swap-in and recompute happen on
  the victim's own worker once it has room again (``wait_s``, the kernel's estimate);
  a migration does not wait. Link figures are the workers'
  measured ones (:mod:`scheduler.links`), recompute the fitted step costs. The
  cheapest restore path is also the victim's mode: SWAP, RECOMPUTE or MIGRATE.

A victim frees its blocks less those another live request shares (a shared prefix
stays), and is ranked by cost per block it frees.

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

from scheduler.deadlines import ServiceEstimate, slack_s
from scheduler.links import LinkPricer
from scheduler.messages import PreemptMode
from scheduler.request import Request
from scheduler.tiers import TierConfig
from scheduler.topology import WorkerInfo, topology_class

EPS = 1e-3
# A victim with less slack than its restore takes is priced as if it had this much left.
SLACK_FLOOR_S = 0.01


class VictimScorer(enum.Enum):
    DESIGN_NOTES = "design-notes"
    TOPOLOGY = "topology"


@dataclass(frozen=True, slots=True)
class VictimView:
    req: Request
    worker: WorkerInfo
    num_blocks: int
    # Blocks of this request that another live request on its worker holds too (a shared
    # prefix): its preemption does not free them, and a recompute there finds them cached.
    num_shared_blocks: int = 0
    # A decode worker with room for the request's blocks, if any (it could migrate there).
    peer: WorkerInfo | None = None
    # Free blocks on ``peer`` (victims that migrate there in one plan share them), and how
    # many of this request's blocks it already caches (they need not travel).
    peer_room: int = 0
    num_peer_cached: int = 0
    # Free blocks of the host swap space of the victim's worker (victims of one plan share
    # them); None: unbounded. A swap that does not fit is never chosen.
    swap_room: int | None = None
    # How long until its worker has room to take it back (swap-in or recompute happen
    # there, after the request it makes room for): a migration to a peer with room now
    # does not wait.
    wait_s: float = 0.0

    @property
    def num_freed(self) -> int:
        """Blocks its preemption gives back to its worker."""
        return max(self.num_blocks - self.num_shared_blocks, 0)


@dataclass(frozen=True, slots=True)
class Victim:
    req_id: str
    mode: PreemptMode
    num_blocks: int  # blocks its preemption frees on its worker
    cost: float
    peer_id: str | None = None  # MIGRATE: where it goes


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


def restore_options(v: VictimView, costs: LinkPricer, est: ServiceEstimate,
                    modes: frozenset[PreemptMode], *, swap_room: int | None = None,
                    peer_room: int | None = None) -> dict[PreemptMode, float]:
    """What bringing the victim back costs (s), per mode it can take: swap needs room in
    its worker's swap space (``swap_room``, default the view's), migrate a peer with room
    for it (``peer_room``, default the view's)."""
    out: dict[PreemptMode, float] = {}
    room = v.swap_room if swap_room is None else swap_room
    if PreemptMode.SWAP in modes and (room is None or v.num_blocks <= room):
        out[PreemptMode.SWAP] = v.wait_s + costs.swap_s(v.num_blocks)
    if PreemptMode.RECOMPUTE in modes:
        ctx = max(v.req.num_context_tokens, 1)
        # Blocks another request keeps cached here need no recompute.
        shared = min(ctx - 1, v.num_shared_blocks * ctx // max(v.num_blocks, 1))
        out[PreemptMode.RECOMPUTE] = v.wait_s + est.prefill_s(ctx - shared, shared)
    peer_left = v.peer_room if peer_room is None else peer_room
    if PreemptMode.MIGRATE in modes and v.peer is not None and v.num_blocks <= peer_left:
        moved = max(v.num_blocks - v.num_peer_cached, 0)
        out[PreemptMode.MIGRATE] = costs.move_s(moved, topology_class(v.worker, v.peer))
    return out


def _score(v: VictimView, scorer: VictimScorer, tiers: TierConfig, restore_s: float,
           slack: float) -> float:
    if scorer is VictimScorer.TOPOLOGY:
        # The restore's work at the tier's weight (it takes capacity from every request
        # the worker serves), raised by the risk that it makes the victim late: its
        # restore against the slack to its own target left once restored (a victim the
        # restore makes late is priced as if it had SLACK_FLOOR_S left).
        risk = restore_s / max(slack - restore_s, SLACK_FLOOR_S)
        return tiers[v.req.tier].weight * restore_s * (1.0 + risk)
    progress = v.req.num_output_tokens / max(v.req.max_new_tokens, 1)
    reuse_value = 1.0 + v.num_shared_blocks / max(v.num_blocks, 1)
    score = v.num_blocks / (progress + EPS) * reuse_value
    return 1.0 / score


def price(v: VictimView, scorer: VictimScorer, tiers: TierConfig, costs: LinkPricer,
          est: ServiceEstimate, modes: frozenset[PreemptMode], *, now: float = 0.0,
          swap_room: int | None = None, peer_room: int | None = None
          ) -> tuple[float, PreemptMode] | None:
    """The victim's cost and cheapest restore mode; None when no mode fits."""
    opts = restore_options(v, costs, est, modes, swap_room=swap_room, peer_room=peer_room)
    if not opts:
        return None
    mode = min(opts, key=lambda m: opts[m])
    return _score(v, scorer, tiers, opts[mode], slack_s(v.req, now, tiers, est)), mode


def choose_victims(need_blocks: int, candidates: Sequence[VictimView], *, requester_tier: int,
                   now: float, tiers: TierConfig, costs: LinkPricer, est: ServiceEstimate,
                   scorer: VictimScorer = VictimScorer.TOPOLOGY,
                   modes: frozenset[PreemptMode] = frozenset(PreemptMode)) -> PreemptionPlan:
    """Cheapest set of eligible victims freeing ``need_blocks`` (or all it can).

    Victims are taken by cost per freed block; each one's mode is settled as it is taken,
    against the swap space and the peers' room the victims before it used, so a plan
    never swaps more than a worker's swap space holds nor migrates more than a peer
    holds (a victim whose cheapest mode no longer fits takes its next cheapest)."""
    if need_blocks <= 0:
        return PreemptionPlan((), 0)
    priced: list[tuple[float, VictimView]] = []
    for v in candidates:
        if v.num_freed <= 0 or not is_eligible(v.req, requester_tier, now, tiers.anti_thrash_s):
            continue
        got = price(v, scorer, tiers, costs, est, modes, now=now)
        if got is not None:
            priced.append((got[0] / v.num_freed, v))
    priced.sort(key=lambda cv: cv[0])
    swap_left: dict[str, int] = {}
    peer_left: dict[str, int] = {}
    chosen: list[Victim] = []
    freed = 0
    for _, v in priced:
        if freed >= need_blocks:
            break
        wid = v.worker.worker_id
        room = None if v.swap_room is None else swap_left.setdefault(wid, v.swap_room)
        peer_id = v.peer.worker_id if v.peer is not None else None
        proom = 0 if peer_id is None else peer_left.setdefault(peer_id, v.peer_room)
        got = price(v, scorer, tiers, costs, est, modes, now=now, swap_room=room,
                    peer_room=proom)
        if got is None:
            continue
        cost, mode = got
        if mode is PreemptMode.SWAP and room is not None:
            swap_left[wid] = room - v.num_blocks
        if mode is PreemptMode.MIGRATE and peer_id is not None:
            peer_left[peer_id] = proom - v.num_blocks
        chosen.append(Victim(v.req.req_id, mode, v.num_freed, cost,
                             peer_id if mode is PreemptMode.MIGRATE else None))
        freed += v.num_freed
    if freed >= need_blocks:
        for victim in sorted(chosen, key=lambda x: -x.cost):
            if freed - victim.num_blocks >= need_blocks:
                chosen.remove(victim)
                freed -= victim.num_blocks
    return PreemptionPlan(tuple(chosen), freed)

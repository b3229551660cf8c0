"""Deliberately broken kernel pieces, to show the checkers can fail.

``tierserve check --inject-fault NAME`` and the tests plug these in through the
checkers' public ``policy_factory`` / ``account_factory`` parameters; a checker
that finds no counterexample with them in place is not checking anything.

- ``thrash``: the tierserve policy with the anti-thrash window switched off in
  its victim choice (a request may be preempted again at once). A preempted
  request needs a step to come back, so on the default 0.5 s clock it shows
  where requests crowd one worker: ``--workers 1 --arrival-ticks 2 --failures 0
  --stops 0`` (and in the trajectories' 50 ms clock).
- ``overbook``: a block account that never says no: ``allocate`` grants past
  the budget and the account always shows a free block, so the schedulers,
  which only ever ask for blocks they were told are free, keep placing work
  (KV in use exceeds the budget); it shows once two requests share a worker
  (``--requests 2 --workers 1``, or the trajectories).
- ``fixed-reserve``: the tierserve policy with the decode placement it had before issue
  22 (fixed per-tier fractions plus growth room from the prior step time): a request
  that fits a worker's free blocks less the measured reserve waits, and the
  work-conservation invariant must fail (two workers, a few requests of a later tier).
- ``inversion``: the tierserve policy with the slack ordering as it was before
  DESIGN §5's rule: every hopeless request behind every feasible one
  (``feasible + hopeless``), in the global queue, the workers' queues and the
  decode batch alike (the tier-order invariant must fail; the default scope
  shows it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from scheduler.kv import KVBlockAccount
from scheduler.ordering import SlackPolicy
from scheduler.placement import DecodeChoice, DecodeView, choose_decode
from scheduler.policy import PolicyContext, TierservePolicy
from scheduler.preemption import PreemptionPlan, VictimView, choose_victims
from scheduler.queues import SortedQueue, WaitQueue
from scheduler.request import Request
from scheduler.step_costs import CPU_PRIOR
from scheduler.topology import WorkerInfo
from scheduler.verify.model import AccountFactory, PolicyFactory


class ThrashingPolicy(TierservePolicy):
    """Tierserve, but victims are chosen as if ``anti_thrash_s`` were 0."""

    name = "tierserve-thrash"

    def _victims(self, need: int, candidates: Sequence[VictimView], tier: int,
                 now: float) -> PreemptionPlan:
        loose = replace(self.tiers, anti_thrash_s=0.0)
        return choose_victims(need, candidates, requester_tier=tier, now=now, tiers=loose,
                              costs=self.ctx.costs, est=self.ctx.est, scorer=self.scorer)

    def preempt_for(self, req: Request, need_blocks: int, free_blocks: int,
                    candidates: Sequence[VictimView], now: float,
                    wait_s: float | None = None) -> PreemptionPlan | None:
        plan = self._victims(max(need_blocks - free_blocks, 0), candidates, req.tier, now)
        return plan if plan.victims else None

    def on_kv_pressure(self, need_blocks: int, candidates: Sequence[VictimView],
                       now: float, requester_tier: int) -> PreemptionPlan:
        return self._victims(need_blocks, candidates, requester_tier, now)


class HopelessLastOrdering(SlackPolicy):
    """The slack order with every hopeless request demoted behind all feasible work,
    whatever its tier (the order before no_inversion)."""

    def order(self, reqs: Sequence[Request], now: float) -> list[Request]:
        guard = sorted((r for r in reqs if self.is_starving(r, now)),
                       key=lambda r: r.arrival_time)
        ids = {r.req_id for r in guard}
        feasible, hopeless = self._split([r for r in reqs if r.req_id not in ids], now)
        top = self.GUARD_YIELDS_TO_TIERS
        head = [r for r in feasible if r.tier < top]
        rest = [r for r in feasible if r.tier >= top]
        return head + guard + rest + hopeless


class InvertingPolicy(TierservePolicy):
    """Tierserve whose slack ordering puts hopeless requests behind all feasible ones;
    it still claims ``keeps_tier_order``, so the checker holds it to the rule."""

    name = "tierserve-inversion"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.ordering = HopelessLastOrdering(ctx.tiers, ctx.est, self.watcher)

    def make_queue(self) -> WaitQueue:
        return SortedQueue(self.ordering)


class FixedReservePolicy(TierservePolicy):
    """Tierserve with the decode placement it had before issue 22: every tier t keeps
    5 % x t of a worker free, plus room for each running request to grow for one
    anti-thrash window at the prior's step time, whatever arrives and whatever the
    worker measures; it still claims ``work_conserving``, so the checker holds it to
    the measured reserve (``decode_reserve``)."""

    name = "tierserve-fixed-reserve"
    HEADROOM = 0.05

    def place_decode(self, req: Request, need_blocks: int, views: Sequence[DecodeView],
                     prefill: WorkerInfo) -> DecodeChoice | None:
        tokens = self.tiers.anti_thrash_s / max(CPU_PRIOR[0] + CPU_PRIOR[3], 1e-6)
        growth = int(tokens // self.ctx.block_size) + 1
        ok = [v for v in views if v.num_free_blocks - need_blocks
              >= self.HEADROOM * req.tier * v.info.num_kv_blocks
              + (v.num_running * growth if req.tier else 0)]
        return choose_decode(need_blocks, ok, prefill, self.ctx.costs, min_headroom=0.1)


class OverbookingAccount(KVBlockAccount):
    """Grants every allocation, even past ``num_total_blocks``, and never shows fewer
    than one free block."""

    @property
    def num_free(self) -> int:
        return max(self.num_total_blocks - self.num_owned - self.num_cached, 1)

    def allocate(self, req_id: str, num_blocks: int) -> bool:
        self.owned[req_id] = self.owned.get(req_id, 0) + num_blocks
        self.num_owned += num_blocks
        return True


def thrashing_policy(ctx: PolicyContext) -> TierservePolicy:
    return ThrashingPolicy(ctx)


def inverting_policy(ctx: PolicyContext) -> TierservePolicy:
    return InvertingPolicy(ctx)


def fixed_reserve_policy(ctx: PolicyContext) -> TierservePolicy:
    return FixedReservePolicy(ctx)


FAULTS: dict[str, tuple[PolicyFactory | None, AccountFactory | None]] = {
    "thrash": (thrashing_policy, None),
    "overbook": (None, OverbookingAccount),
    "inversion": (inverting_policy, None),
    "fixed-reserve": (fixed_reserve_policy, None),
}


def fault(name: str) -> tuple[PolicyFactory | None, AccountFactory | None]:
    got = FAULTS.get(name)
    if got is None:
        raise ValueError(f"unknown fault {name!r}; valid: {', '.join(sorted(FAULTS))}")
    return got



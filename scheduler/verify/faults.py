"""Deliberately broken kernel pieces, to show the checkers can fail.

``tierserve check --inject-fault NAME`` and the tests plug these in through the
checkers' public ``policy_factory`` / ``account_factory`` parameters; a checker
that finds no counterexample with them in place is not checking anything.

- ``thrash``: the tierserve policy with the anti-thrash window switched off in
  its victim choice (a request may be preempted again at once).
- ``overbook``: a block account whose ``allocate`` never says no (KV in use
  can exceed the budget).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from scheduler.kv import KVBlockAccount
from scheduler.policy import PolicyContext, TierservePolicy
from scheduler.preemption import PreemptionPlan, VictimView, choose_victims
from scheduler.request import Request
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
                    candidates: Sequence[VictimView], now: float) -> PreemptionPlan | None:
        plan = self._victims(max(need_blocks - free_blocks, 0), candidates, req.tier, now)
        return plan if plan.victims else None

    def on_kv_pressure(self, need_blocks: int, candidates: Sequence[VictimView],
                       now: float, requester_tier: int) -> PreemptionPlan:
        return self._victims(need_blocks, candidates, requester_tier, now)


class OverbookingAccount(KVBlockAccount):
    """Grants every allocation, even past ``num_total_blocks``."""

    def allocate(self, req_id: str, num_blocks: int) -> bool:
        self.owned[req_id] = self.owned.get(req_id, 0) + num_blocks
        self.num_owned += num_blocks
        return True


def thrashing_policy(ctx: PolicyContext) -> TierservePolicy:
    return ThrashingPolicy(ctx)


FAULTS: dict[str, tuple[PolicyFactory | None, AccountFactory | None]] = {
    "thrash": (thrashing_policy, None),
    "overbook": (None, OverbookingAccount),
}


def fault(name: str) -> tuple[PolicyFactory | None, AccountFactory | None]:
    got = FAULTS.get(name)
    if got is None:
        raise ValueError(f"unknown fault {name!r}; valid: {', '.join(sorted(FAULTS))}")
    return got



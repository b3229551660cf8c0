"""The policy registry: scheduling policies chosen by name.

``make_policy("tierserve", ctx)`` builds this project's policy (optionally with
``ordering="utility" | "slack" | "wfq"``); the peer names build the policies of
:mod:`scheduler.peers`. An unknown name raises
:class:`scheduler.ordering.UnknownPolicy` listing the valid ones.
"""

from __future__ import annotations

from scheduler.ordering import DEFAULT_ORDERING, UnknownPolicy
from scheduler.peers import (
    DynamoPriorityPolicy,
    SglangLpmPolicy,
    VllmFcfsPolicy,
    VllmPriorityPolicy,
)
from scheduler.policy import PolicyContext, SchedulingPolicy, TierservePolicy

PEER_POLICIES: dict[str, type[SchedulingPolicy]] = {
    VllmFcfsPolicy.name: VllmFcfsPolicy,
    VllmPriorityPolicy.name: VllmPriorityPolicy,
    SglangLpmPolicy.name: SglangLpmPolicy,
    DynamoPriorityPolicy.name: DynamoPriorityPolicy,
}
# "tierserve:utility" etc. pick tierserve with another ordering policy.
POLICY_NAMES: tuple[str, ...] = ("tierserve", *PEER_POLICIES)


def make_policy(name: str, ctx: PolicyContext) -> SchedulingPolicy:
    base, _, ordering = name.partition(":")
    if base == TierservePolicy.name:
        return TierservePolicy(ctx, ordering=ordering or DEFAULT_ORDERING)
    cls = PEER_POLICIES.get(name)
    if cls is None:
        raise UnknownPolicy(
            f"unknown scheduling policy {name!r}; valid: {', '.join(POLICY_NAMES)} "
            "(tierserve:<ordering> with ordering utility, slack or wfq)"
        )
    return cls(ctx)

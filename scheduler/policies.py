"""The policy registry: scheduling policies chosen by name, with their settings.

``make_policy("tierserve", ctx)`` builds this project's policy; a spec with settings
(``"tierserve:ordering=wfq"``, its short form ``"tierserve:wfq"``, or
``"vllm-priority:max_num_batched_tokens=2048"``; :mod:`scheduler.policy_spec`) builds it
with them. The peer names build the policies of :mod:`scheduler.peers`. An unknown name
raises :class:`scheduler.ordering.UnknownPolicy` listing the valid ones; an unknown
setting or a bad value raises :class:`scheduler.policy_spec.PolicySpecError`.
"""

from __future__ import annotations

from scheduler.ordering import UnknownPolicy
from scheduler.peers import (
    DynamoPriorityPolicy,
    SglangFcfsPolicy,
    SglangLpmPolicy,
    VllmFcfsPolicy,
    VllmPriorityPolicy,
)
from scheduler.policy import PolicyContext, SchedulingPolicy, TierservePolicy
from scheduler.policy_spec import PolicySpec, PolicySpecError, build_settings, parse_spec

PEER_POLICIES: dict[str, type[SchedulingPolicy]] = {
    VllmFcfsPolicy.name: VllmFcfsPolicy,
    VllmPriorityPolicy.name: VllmPriorityPolicy,
    SglangLpmPolicy.name: SglangLpmPolicy,
    SglangFcfsPolicy.name: SglangFcfsPolicy,
    DynamoPriorityPolicy.name: DynamoPriorityPolicy,
}
POLICIES: dict[str, type[SchedulingPolicy]] = {TierservePolicy.name: TierservePolicy,
                                               **PEER_POLICIES}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
# What a bare value after the colon sets, per policy ("tierserve:wfq").
_SHORT_KEYS = {TierservePolicy.name: "ordering"}


def policy_spec(spec: str | PolicySpec) -> PolicySpec:
    """``spec`` parsed, its policy known (its settings are checked by ``make_policy``)."""
    if isinstance(spec, str):
        name = spec.partition(":")[0].strip()
        spec = parse_spec(spec, _SHORT_KEYS.get(name))
    if spec.name not in POLICIES:
        raise UnknownPolicy(
            f"unknown scheduling policy {spec.name!r}; valid: {', '.join(POLICY_NAMES)} "
            "(with settings: NAME:key=value,...; tierserve:<ordering> with ordering utility, "
            "slack, wfq or tier)")
    return spec


def check_policy(spec: str | PolicySpec) -> PolicySpec:
    """The parsed spec, its name and settings checked (no context needed)."""
    spec = policy_spec(spec)
    cls = POLICIES[spec.name]
    if cls.settings_cls is not None:
        build_settings(cls.settings_cls, spec)
    elif spec.settings:
        raise PolicySpecError(f"{spec.name}: takes no settings")
    return spec


def make_policy(spec: str | PolicySpec, ctx: PolicyContext) -> SchedulingPolicy:
    spec = check_policy(spec)
    cls = POLICIES[spec.name]
    if cls.settings_cls is None:
        return cls(ctx)
    return cls(ctx, build_settings(cls.settings_cls, spec))  # type: ignore[call-arg]

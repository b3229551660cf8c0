"""What the peer policies share: recompute victims taken in a given order."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.preemption import PreemptionPlan, PreemptMode, Victim, VictimView


def recompute_in_order(victims: Sequence[VictimView], need_blocks: int) -> PreemptionPlan:
    """Victims in the order given, each by recompute, until ``need_blocks`` are freed (the
    engines preempt one request at a time until the allocation fits)."""
    chosen: list[Victim] = []
    freed = 0
    for v in victims:
        if freed >= need_blocks:
            break
        chosen.append(Victim(v.req.req_id, PreemptMode.RECOMPUTE, v.num_blocks, 0.0))
        freed += v.num_blocks
    return PreemptionPlan(tuple(chosen), freed)

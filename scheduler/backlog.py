"""A worker's queued prefill work, as the cluster scheduler books it.

:class:`PrefillBook` holds, per request, the prompt tokens still to prefill on one worker,
and keeps running sums per tier so that the queued work in seconds (what placement,
admission and the dispatch horizon read on every decision) costs O(tiers), not a walk
over every queued request. A request's isolated prefill of ``n`` tokens is predicted by
:meth:`scheduler.step_costs.StepCosts.prefill_s` as ``steps(n) c0 + n c1 + n^2/2 c2``,
linear in the coefficients, so the sums of ``steps(n)``, ``n`` and ``n^2/2`` per tier give
the sum of the requests' predictions for whatever coefficients the worker reports next.
The seconds are kept until the book or the coefficients change: admission and placement
read a worker's backlog in the same decision, and a plan reads it per request offered.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from scheduler.step_costs import StepCosts


class Coefficients(Protocol):
    """A step-cost model's first three coefficients (fixed, per token, per attention
    unit): a worker's StepCosts, or the cluster's mean of them."""

    @property
    def coefficients(self) -> tuple[float, ...]: ...


class PrefillBook:
    """Request -> prompt tokens left to prefill here (> 0), with sums per tier (and, given
    a block size, the KV blocks those prompts need: ``ceil((n + 1) / block_size)`` each)."""

    __slots__ = ("_left", "_tier", "_steps", "_tokens", "_sq", "_chunk", "_total", "_bs",
                 "_blocks", "_tier_coefs", "_tier_s", "_tier_changed", "_total_costs", "_total_coefs",
                 "_total_s")

    def __init__(self, num_tiers: int, chunk_tokens: int, block_size: int = 0) -> None:
        self._left: dict[str, int] = {}
        self._tier: dict[str, int] = {}
        self._steps = [0] * num_tiers
        self._tokens = [0] * num_tiers
        self._sq = [0] * num_tiers
        self._blocks = [0] * num_tiers
        self._chunk = max(1, chunk_tokens)
        self._bs = block_size
        self._total = 0
        # by_tier_s and backlog_s as last computed, with the coefficients (and the cost
        # model) they were computed for (None: recompute), and the tiers whose sums
        # changed since (a bit each).
        self._tier_coefs: tuple[float, ...] | None = None
        self._tier_s: tuple[float, ...] = ()
        self._tier_changed = 0
        self._total_costs: StepCosts | None = None
        self._total_coefs: tuple[float, ...] | None = None
        self._total_s = 0.0

    def _add(self, tier: int, left: int, sign: int) -> None:
        self._tier_changed |= 1 << tier
        self._total_costs = None
        self._steps[tier] += sign * max(1, -(-left // self._chunk))
        self._tokens[tier] += sign * left
        self._sq[tier] += sign * left * left
        self._total += sign * left
        if self._bs:
            self._blocks[tier] += sign * -(-(left + 1) // self._bs)

    def put(self, req_id: str, left: int, tier: int | None = None) -> None:
        """Book ``left`` tokens for ``req_id`` (its tier: as booked before unless given);
        0 or less removes it."""
        old = self._left.get(req_id)
        if old is not None:
            t = self._tier[req_id]
            self._add(t, old, -1)
            tier = t if tier is None else tier
        if tier is None:
            raise KeyError(f"{req_id}: a new entry needs its tier")
        if left <= 0:
            self._left.pop(req_id, None)
            self._tier.pop(req_id, None)
            return
        self._left[req_id] = left
        self._tier[req_id] = tier
        self._add(tier, left, +1)

    def pop(self, req_id: str) -> int | None:
        old = self._left.pop(req_id, None)
        if old is not None:
            self._add(self._tier.pop(req_id), old, -1)
        return old

    def get(self, req_id: str) -> int | None:
        return self._left.get(req_id)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._left

    def __iter__(self) -> Iterator[str]:
        return iter(self._left)

    def __len__(self) -> int:
        return len(self._left)

    def as_dict(self) -> dict[str, int]:
        return dict(self._left)

    @property
    def num_tokens(self) -> int:
        return self._total

    def blocks_by_tier(self) -> tuple[int, ...]:
        """Per tier: the KV blocks its prompts need (0 without a block size)."""
        return tuple(self._blocks)

    def backlog_s(self, costs: StepCosts) -> float:
        """All of it as one prefill (what the worker has to get through)."""
        if not self._total:
            return 0.0
        coefs = costs.coefficients
        if self._total_costs is not costs or self._total_coefs is not coefs:
            self._total_s = costs.prefill_s(self._total, 0)
            self._total_costs, self._total_coefs = costs, coefs
        return self._total_s

    def by_tier_s(self, costs: Coefficients) -> tuple[float, ...]:
        """Per tier: the sum of its requests' isolated prefills."""
        coefs = costs.coefficients
        changed = self._tier_changed
        if self._tier_coefs is not coefs:
            changed = (1 << len(self._steps)) - 1
        if changed:
            c0, c1, c2 = coefs[:3]
            out = list(self._tier_s) or [0.0] * len(self._steps)
            t = 0
            while changed:
                if changed & 1:
                    out[t] = c0 * self._steps[t] + c1 * self._tokens[t] + c2 * self._sq[t] / 2
                changed >>= 1
                t += 1
            self._tier_s = tuple(out)
            self._tier_coefs = coefs
            self._tier_changed = 0
        return self._tier_s


__all__ = ["PrefillBook"]

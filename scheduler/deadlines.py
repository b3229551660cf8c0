"""Deadlines, predicted remaining work and the deadline watcher.

Every ordering and admission decision needs, per request: its binding deadline
(absolute time), the work left before that deadline (seconds, predicted from a
:class:`ServiceEstimate`), and so its slack = deadline - now - work. The
simulator's cost model and the engine's measured figures both satisfy
:class:`ServiceEstimate`. :class:`DeadlineWatcher` runs every control interval
(100 ms by default) and marks requests that have used ``boost_fraction`` of
their deadline, which the WFQ policy serves first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from scheduler.request import Request, RequestState
from scheduler.tiers import TierConfig


class ServiceEstimate(Protocol):
    """Predicted service times; implementations must be cheap (called per decision)."""

    def prefill_s(self, num_new_tokens: int, num_context_tokens: int) -> float:
        """Time to prefill ``num_new_tokens`` after ``num_context_tokens`` cached ones."""
        ...

    def decode_token_s(self) -> float:
        """Typical time per output token of one request under normal load."""
        ...


def deadline(req: Request, tiers: TierConfig) -> float:
    """The absolute deadline that binds next.

    Before the first token: TTFT (else end to end). After it: end to end when the
    tier has one, else the pace the TPOT target sets for the tokens so far.
    """
    spec = tiers[req.tier]
    if req.first_token_time is None:
        if spec.ttft_s is not None:
            return req.arrival_time + spec.ttft_s
        return req.arrival_time + spec.deadline_s
    if spec.e2e_s is not None:
        return req.arrival_time + spec.e2e_s
    tpot = spec.tpot_s if spec.tpot_s is not None else 0.0
    return req.first_token_time + tpot * max(req.num_output_tokens, 1)


def deadline_span(req: Request, tiers: TierConfig) -> float:
    """Length of the window the binding deadline closes (for 'fraction used')."""
    spec = tiers[req.tier]
    if req.first_token_time is None and spec.ttft_s is not None:
        return spec.ttft_s
    return spec.deadline_s if spec.e2e_s is not None else max(deadline(req, tiers) - req.arrival_time, 1e-9)


def remaining_work_s(req: Request, tiers: TierConfig, est: ServiceEstimate) -> float:
    """Predicted work left before the binding deadline can be met."""
    spec = tiers[req.tier]
    work = 0.0
    if req.first_token_time is None or req.state is RequestState.QUEUED:
        todo = max(req.num_context_tokens - req.num_computed_tokens, 1)
        work += est.prefill_s(todo, req.num_computed_tokens)
    if req.first_token_time is None and spec.ttft_s is not None:
        return work
    if spec.e2e_s is not None:
        work += max(req.max_new_tokens - req.num_output_tokens, 0) * est.decode_token_s()
    else:
        work += est.decode_token_s()
    return work


def slack_s(req: Request, now: float, tiers: TierConfig, est: ServiceEstimate) -> float:
    return deadline(req, tiers) - now - remaining_work_s(req, tiers, est)


def last_progress_time(req: Request) -> float:
    """When the request last changed state (its arrival if never)."""
    return req.history[-1].time if req.history else req.arrival_time


class DeadlineWatcher:
    """Marks requests that have used ``boost_fraction`` of their deadline window.

    ``tick`` acts at most once per control interval and returns the ids boosted
    by that tick; ``is_boosted`` answers for the ordering policies.
    """

    def __init__(self, tiers: TierConfig) -> None:
        self.tiers = tiers
        self.boosted_ids: set[str] = set()
        self._last_tick = float("-inf")

    def tick(self, now: float, reqs: Iterable[Request]) -> list[str]:
        if now - self._last_tick < self.tiers.control_interval_s:
            return []
        self._last_tick = now
        frac = self.tiers.boost_fraction
        new: list[str] = []
        for r in reqs:
            if r.req_id in self.boosted_ids or r.state.is_finished:
                continue
            used = (now - r.arrival_time) / deadline_span(r, self.tiers)
            if used >= frac:
                self.boosted_ids.add(r.req_id)
                new.append(r.req_id)
        return new

    def forget(self, req_id: str) -> None:
        self.boosted_ids.discard(req_id)

    def is_boosted(self, req: Request) -> bool:
        return req.req_id in self.boosted_ids


class LinearEstimate:
    """A :class:`ServiceEstimate` from three measured constants (no batch effects)."""

    __slots__ = ("prefill_base_s", "prefill_per_token_s", "decode_per_token_s")

    def __init__(self, prefill_per_token_s: float, decode_per_token_s: float,
                 prefill_base_s: float = 0.0) -> None:
        for name, v in (("prefill_per_token_s", prefill_per_token_s),
                        ("decode_per_token_s", decode_per_token_s),
                        ("prefill_base_s", prefill_base_s)):
            if not v >= 0:
                raise ValueError(f"{name}: must be >= 0, got {v}")
        self.prefill_base_s = prefill_base_s
        self.prefill_per_token_s = prefill_per_token_s
        self.decode_per_token_s = decode_per_token_s

    def prefill_s(self, num_new_tokens: int, num_context_tokens: int) -> float:
        return self.prefill_base_s + num_new_tokens * self.prefill_per_token_s

    def decode_token_s(self) -> float:
        return self.decode_per_token_s

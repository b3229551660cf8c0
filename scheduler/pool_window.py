"""What the SLO planner reads, gathered over one window from what the scheduler sees.

The global scheduler already sees every request end and every worker report; this
object keeps, for the window since the planner last stepped, how tier-0 requests ended
(met their targets or not, and whether a miss was of the time to first token: prefill
and queueing, or of the pace: decode) and how much of the window each worker spent in
steps (from the ``step_seconds`` counter its reports carry). :meth:`close` turns that into
the planner's :class:`~scheduler.pool_planner.PoolSignals` and starts the next window.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.pool_planner import Pool, PoolSignals, busy_fraction
from scheduler.request import Decision, Request, RequestState
from scheduler.tiers import TierSpec

_DONE = (RequestState.FINISHED_STOPPED, RequestState.FINISHED_LENGTH)


@dataclass(slots=True)
class _Seen:
    pool: Pool
    first: float  # its step_seconds counter when the window started (or it joined)
    last: float


class PoolWindow:
    def __init__(self, start: float) -> None:
        self.start = start
        self.tier0_met = 0
        self.tier0_missed = 0
        self.tier0_ttft_missed = 0
        self._workers: dict[str, _Seen] = {}

    def on_closed(self, req: Request, spec: TierSpec) -> None:
        """A request ended; only tier 0's count (the planner's promise is tier 0's)."""
        if req.tier != 0:
            return
        ttft = (None if req.first_token_time is None
                else req.first_token_time - req.arrival_time)
        late_first = ttft is None or (spec.ttft_s is not None and ttft > spec.ttft_s)
        if req.state in _DONE and not late_first and _paced(req, spec):
            self.tier0_met += 1
            return
        if req.state is RequestState.ABORTED and req.history and (
                req.history[-1].decision is Decision.CLIENT_GONE):
            return  # its client left: not a capacity signal (a failure or timeout is)
        self.tier0_missed += 1
        if late_first:
            self.tier0_ttft_missed += 1

    def on_report(self, worker_id: str, pool: Pool, step_seconds: float) -> None:
        seen = self._workers.get(worker_id)
        if seen is None or seen.pool is not pool or step_seconds < seen.last:
            # New here, or a restarted process (its counter started again).
            self._workers[worker_id] = _Seen(pool, step_seconds, step_seconds)
            return
        seen.last = step_seconds

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def close(self, now: float, num_prefill: int, num_decode: int, kv_used: float,
              tier0_prefill_queued: bool) -> PoolSignals:
        """The window's signals; the next window starts at ``now``. ``kv_used``: the decode
        workers' KV in use now; ``tier0_prefill_queued``: tier-0 prefill work waits now."""
        window = max(now - self.start, 1e-9)
        busy = {Pool.PREFILL: 0.0, Pool.DECODE: 0.0}
        for seen in self._workers.values():
            busy[seen.pool] += seen.last - seen.first
            seen.first = seen.last
        total = self.tier0_met + self.tier0_missed
        sig = PoolSignals(
            now, num_prefill, num_decode,
            None if total == 0 else self.tier0_met / total,
            tier0_prefill_queued or self.tier0_ttft_missed > 0,
            busy_fraction(busy[Pool.PREFILL], window, num_prefill),
            busy_fraction(busy[Pool.DECODE], window, num_decode),
            min(max(kv_used, 0.0), 1.0))
        self.start = now
        self.tier0_met = self.tier0_missed = self.tier0_ttft_missed = 0
        return sig


def _paced(req: Request, spec: TierSpec) -> bool:
    """Within its time per output token and end-to-end targets."""
    if req.finish_time is None or req.first_token_time is None:
        return False
    n = req.num_output_tokens
    tpot = (req.finish_time - req.first_token_time) / (n - 1) if n > 1 else 0.0
    e2e = req.finish_time - req.arrival_time
    return ((spec.tpot_s is None or tpot <= spec.tpot_s)
            and (spec.e2e_s is None or e2e <= spec.e2e_s))

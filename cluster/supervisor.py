"""Who is alive: the global scheduler's watch over its workers (issue 13, DESIGN §7).

How a dead or hung worker is replaced, and why this way:

- **Ray restarts the process; the worker registers itself.** Worker actors and the
  scheduler actor run with ``max_restarts=-1``. A crashed process (killed, OOM, segfault,
  a lost node) is started again by Ray under the same name and actor id, so every handle
  the routers, the scheduler and the peers hold keeps working, on ``tierserve serve`` and
  on KubeRay's detached actors alike, and nothing outside Ray has to stay alive to bring it
  back. The new process sets itself up in ``__init__`` (model, KV endpoint) and sends the
  scheduler a ``WorkerHello`` with a new ``incarnation``; the scheduler gives it a fresh
  slot and it serves. Its KV-transfer pairs are rebuilt lazily, as every pair is: a
  consumer's new address travels in its next ticket, a producer opens a pair on its next
  ``begin``.
- **This watch only decides when a process must die.** A supervisor that created
  replacement actors itself would have had to hand every holder a new handle, live in the
  scheduler (which may be the one that died) and repeat Ray's placement; Ray's own restart
  has none of those problems. What Ray cannot see is a process that is alive but useless:
  one that answers no ping, or one that has work and makes no step. For those the
  scheduler ``ray.kill``\\s the actor with ``no_restart=False`` (Ray then restarts it).
- ``ray.kill(actor, no_restart=True)`` stays the way to remove a worker for good: the
  watch reads that as ``ActorDiedError`` and leaves it dead.

:class:`ProgressWatch` is the plain part (no Ray): each worker's last report, whether it was
busy, and since when its step count has not moved. The actor's health loop
(``cluster/scheduler_actor.py``) feeds it reports and pings and acts on its verdicts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Verdict(enum.Enum):
    """Why the watch gives up on a worker."""

    STALLED = "stalled"  # busy, and no step for the stall bound (hung engine, wedged loop)
    SILENT = "silent"  # busy, and no report for the stall bound (hung event loop)
    UNHEALTHY = "unhealthy"  # says so in its report (a KV accept thread down for good)


@dataclass(slots=True)
class _Seen:
    incarnation: str
    num_steps: int = 0
    is_busy: bool = False
    last_report: float = 0.0
    # Since when the worker has been busy without its step count moving.
    stuck_since: float | None = None
    # Its last report said a part its steps do not exercise is down (WorkerReport.is_healthy).
    is_healthy: bool = True


class ProgressWatch:
    """Per worker: is it busy, and when did its step count last move.

    A worker is judged only while it says it is busy (its steps have requests to advance):
    an idle worker makes no steps and is fine. ``stall_s`` must exceed the longest
    legitimate step (a long prefill chunk on a CPU takes seconds).
    """

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._seen: dict[str, _Seen] = {}

    def watch(self, worker_id: str, incarnation: str, now: float) -> None:
        """Start watching a (re)registered worker from scratch."""
        self._seen[worker_id] = _Seen(incarnation, last_report=now)

    def forget(self, worker_id: str) -> None:
        self._seen.pop(worker_id, None)

    def incarnation(self, worker_id: str) -> str | None:
        seen = self._seen.get(worker_id)
        return None if seen is None else seen.incarnation

    def on_report(self, worker_id: str, incarnation: str, num_steps: int, is_busy: bool,
                  now: float, is_healthy: bool = True) -> bool:
        """Record a report; False when it is not from the watched incarnation."""
        seen = self._seen.get(worker_id)
        if seen is None or (incarnation and incarnation != seen.incarnation):
            return False
        seen.is_healthy = is_healthy
        moved = num_steps != seen.num_steps
        seen.num_steps = num_steps
        seen.last_report = now
        if not is_busy or moved:
            seen.stuck_since = now if is_busy else None
        elif seen.stuck_since is None:
            seen.stuck_since = now
        seen.is_busy = is_busy
        return True

    def verdicts(self, now: float) -> list[tuple[str, Verdict]]:
        """Workers to give up on now, and why."""
        out = []
        for wid, seen in self._seen.items():
            if not seen.is_healthy:  # busy or idle: it cannot take new work as it should
                out.append((wid, Verdict.UNHEALTHY))
                continue
            if not seen.is_busy:
                continue
            if now - seen.last_report > self.stall_s:
                out.append((wid, Verdict.SILENT))
            elif seen.stuck_since is not None and now - seen.stuck_since > self.stall_s:
                out.append((wid, Verdict.STALLED))
        return out

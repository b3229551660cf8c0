"""Simulated workers: the state a prefill or decode worker holds in the simulator.

The simulator (:mod:`scheduler.sim.simulator`) owns the clock and applies the
policy's plans to these; the kernel pieces they hold (wait queue, prefix index,
KV block account) are the same classes a live worker uses.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from scheduler.kv import KVBlockAccount
from scheduler.prefix_index import PrefixIndex
from scheduler.queues import WaitQueue
from scheduler.request import Request
from scheduler.sim.traces import TraceRequest
from scheduler.topology import TopologyClass, WorkerInfo


@dataclass(slots=True)
class Job:
    """The simulator's bookkeeping for one request."""

    req: Request
    trace: TraceRequest
    # Tokens the next prefill must hold KV for (prompt, or prompt + output on recompute).
    ctx_target: int = 0
    prefill: PrefillWorker | None = None
    decode: DecodeWorker | None = None
    move_class: TopologyClass = TopologyClass.SAME_DOMAIN
    num_pinned: int = 0  # prefix entries pinned on the prefill worker's index
    queued_est: float = 0.0  # this job's share of its prefill worker's backlog
    num_blocks: int = 0  # decode blocks held (or to restore, when swapped out)
    started: bool = False  # prefill began on the current prefill worker
    num_tokens_served: int = 0
    num_loaded_blocks: int = 0  # prefix blocks to copy in from the host tier this step
    kv_wanted: int = 0  # decode blocks it waits for (queued, no reservation yet)


@dataclass(slots=True)
class PrefillWorker:
    info: WorkerInfo
    queue: WaitQueue
    index: PrefixIndex | None
    backlog: list[float]
    busy: bool = False
    batch: list[tuple[Job, int]] = field(default_factory=list)
    accesses: list[tuple[int, ...]] = field(default_factory=list)
    protected: Collection[int] | None = None  # per-step memo of protected hashes

    @property
    def backlog_s(self) -> float:
        return sum(self.backlog)


@dataclass(slots=True)
class DecodeWorker:
    info: WorkerInfo
    account: KVBlockAccount
    running: dict[str, Job] = field(default_factory=dict)
    pending: list[Job] = field(default_factory=list)
    swapped: list[Job] = field(default_factory=list)
    # Victims chosen while a step was running; applied at the step's end.
    doomed: list[tuple[str, object]] = field(default_factory=list)
    busy: bool = False
    version: int = 0
    step_start: float = 0.0
    step_dt: float = 0.0
    step_k: int = 0
    batch: list[Job] = field(default_factory=list)

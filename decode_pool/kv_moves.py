"""A decode worker's KV moves: migrations in and out, and what it measures of them.

A migration (issue 15) moves a decoding request to another decode worker with its KV:

1. OUT (the source, on the kernel's PreemptOrder MIGRATE): the engine detaches the
   request (``detach_for_migration``: it leaves the step planner, its blocks stay); the
   target gets a ``MigrateIn`` (spec, outputs so far) and answers a ticket for blocks it
   reserved; the source's ``KVProducer`` pushes every block at once. A refusal (no room,
   the target unreachable) reattaches the request here: the preemption did not happen.
2. IN (the target): reserve the blocks (its prefix cache may hold the prompt's first
   ones: not sent), expect the transfer; once it is DONE the engine takes the request
   over (``add_migrated_request``), RESUMED_MIGRATE is reported, and the output so far
   is streamed again from index 0 (``TokenDelta.start``): the router keeps what it has
   not seen, whichever stream arrives first, so there is no gap and no repeated token.
3. HANDOFF (the source): producer DONE -> the blocks are freed, PREEMPTED_MIGRATE is
   reported, and they are held for the arrival that the preemption was for.
4. FAILURE: the transfer fails or is aborted (the target died mid-transfer, or the kernel
   saw it die and asked the source to recompute the request): the source recomputes it
   itself (PREEMPTED_RECOMPUTE); the target drops its reservation silently (the source
   owns the request until the handoff). A source that dies takes the request with it
   (the kernel ends it with ``worker_failed``; its router retries it by recompute).

The source owns the request until the handoff; the target owns it from then on. What the
worker timed (migrations, swaps) goes to the kernel's link model as ``LinkSample``s, and
how long each restore took as ``RestoreStat``s, in its ``KVMemoryReport``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.migration import MigrationSnapshot
from scheduler.messages import (
    KVMemoryReport,
    LinkKind,
    LinkSample,
    MigrateAnswer,
    MigrateIn,
    PreemptMode,
    RestoreStat,
)

# Asks a target decode worker to take a request over; raises when it is unreachable.
MigrateFn = Callable[[str, MigrateIn], Awaitable[MigrateAnswer]]


@dataclass(slots=True)
class Outbound:
    """A request leaving this worker: its KV is on the wire to ``target_id``."""

    target_id: str
    for_req_id: str | None
    snapshot: MigrationSnapshot
    started: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class Inbound:
    """A request arriving here by migration: its blocks are reserved, its KV on the way."""

    msg: MigrateIn
    reserved_at: float = field(default_factory=time.perf_counter)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.msg.spec.prompt_token_ids + self.msg.output_token_ids


class MemoryLedger:
    """What goes into the worker's ``KVMemoryReport``: measured moves and restores since
    the last report, and the engine's swap space and prefix counters."""

    def __init__(self, bytes_per_block: int) -> None:
        self.bytes_per_block = bytes_per_block
        self._samples: list[LinkSample] = []
        self._restores: list[RestoreStat] = []
        self.num_restores: dict[str, int] = {}

    def moved(self, num_bytes: int, seconds: float, peer_worker_id: str) -> None:
        self._samples.append(LinkSample(LinkKind.MOVE, num_bytes, seconds, peer_worker_id))

    def swapped(self, kind: LinkKind, num_blocks: int, seconds: float) -> None:
        self._samples.append(LinkSample(kind, num_blocks * self.bytes_per_block, seconds))

    def restored(self, req_id: str, mode: PreemptMode, seconds: float, from_worker_id: str = "", *,
                 num_cached_tokens: int = 0) -> None:
        self._restores.append(RestoreStat(req_id, mode, seconds, from_worker_id,
                                          num_cached_tokens))
        self.num_restores[mode.value] = self.num_restores.get(mode.value, 0) + 1

    def report(self, engine: Any) -> KVMemoryReport:
        swap = engine.swap
        out = KVMemoryReport(swap.capacity, swap.num_used, swap.num_peak,
                             engine.num_prefix_query_blocks, engine.num_prefix_hit_blocks,
                             tuple(self._samples), tuple(self._restores))
        self._samples, self._restores = [], []
        return out


def shared_prefix_blocks(engine: Any, block_ids: list[int]) -> int:
    """Leading blocks another request holds too (shared prefix blocks come first)."""
    n = 0
    for b in block_ids:
        if engine.pool.ref_count(b) < 2:
            break
        n += 1
    return n

"""Per-request transfer records, the table that owns them, and shared helpers of both sides.

A record's state only moves forward (PENDING -> TRANSFERRING -> terminal) and the first
terminal state wins: :meth:`TransferTable.finish` refuses to overwrite one. Ending a record
takes its ``io_lock`` first, so a write (consumer) or read (producer) of its blocks that is in
progress completes before the state turns terminal, and none starts afterwards.

Liveness: each side's :class:`Watchdog` fails a transfer nothing was heard of within its
timeout: ``start_timeout_s`` while PENDING, ``stall_timeout_s`` once blocks move. What is
heard (``TransferRecord.last_alive``) is a block moved, or a keepalive: the producer's
caller vouches, with ``KVProducer.keepalive``, for a transfer whose blocks are not computed
yet (a prompt queued behind more urgent ones, or paused between its chunks, for as long as
the policy likes), and the producer passes that on to the consumer as a ``Keepalive``
message at most every :func:`keepalive_interval_s`. So the timeouts catch a hung or dead
peer only: a caller that stops vouching (its loop is stuck), a producer process that stops
(no keepalive reaches the consumer), a consumer that stops taking blocks (the sends do not
complete); a peer that dies breaks the pair at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtransfer.plan import Segment
from kvtransfer.state import (
    FailReason,
    Side,
    TopologyClass,
    TransferConfig,
    TransferState,
    TransferStats,
    TransferStatus,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferRecord:
    req_id: str
    role: Side
    block_ids: list[int]  # the consumer's slots, in prompt order
    present: frozenset[int]  # positions already valid at the consumer (never sent)
    num_total: int  # blocks that travel
    tag: int = 0  # the channel tag of this transfer's segments (from the ticket)
    segment_blocks: int = 1  # the consumer's segment size (from the ticket)
    segments: list[Segment] = field(default_factory=list)  # the plan (kvtransfer.plan)
    created: float = field(default_factory=time.monotonic)
    state: TransferState = TransferState.PENDING
    reason: FailReason | None = None
    failed_side: Side | None = None
    detail: str = ""
    link: Any = None  # the pair link serving it, once known
    topology: TopologyClass | None = None
    backend: str = ""
    num_done: int = 0
    num_bytes: int = 0
    started: float | None = None
    # The last sign of life: a block moved, or a keepalive (the timeouts run from here).
    last_alive: float = field(default_factory=time.monotonic)
    # producer
    cursor: int = 0  # next position push() will fill
    src: list[int] = field(default_factory=list)  # pushed source block ids, by position
    num_issued: int = 0  # segments handed to the channel
    ready: bool = False  # posted path: the consumer posted every receive
    posted: bool = False  # posted path (else announced)
    flushed: bool = False  # posted path: every segment not sent got its empty message instead
    confirming: bool = False  # the stall watchdog asked the sender to settle it
    keepalive_sent: float = field(default_factory=time.monotonic)  # last one to the consumer
    # consumer
    num_landed: int = 0  # segments written into the slots
    # posted path: one receive per segment (layer-major: per slab of the window), owned by
    # the waiter
    works: list[Any] | None = None
    waiter: threading.Thread | None = None  # posted path: the thread that waits for them
    # posted path: the terminal state to take once every receive has had its message
    cancel: tuple[TransferState, FailReason | None, Side | None, str] | None = None
    cancel_since: float = 0.0
    io_lock: threading.RLock = field(default_factory=threading.RLock)

    def mark_progress(self, num_blocks: int, num_bytes: int) -> None:
        now = time.monotonic()
        if self.started is None:
            self.started = now
        if self.state is TransferState.PENDING:
            self.state = TransferState.TRANSFERRING
        self.num_done += num_blocks
        self.num_bytes += num_bytes
        self.last_alive = now

    def status(self) -> TransferStatus:
        return TransferStatus(
            state=self.state,
            reason=self.reason,
            failed_side=self.failed_side,
            detail=self.detail,
            num_blocks_done=self.num_done,
            num_blocks_total=self.num_total,
        )


class TransferTable:
    """Records by request id for one endpoint, plus the finished transfers' stats."""

    def __init__(self, role: Side, max_stats: int = 10_000) -> None:
        self.role = role
        self.lock = threading.RLock()
        self._records: dict[str, TransferRecord] = {}
        self._stats: deque[TransferStats] = deque(maxlen=max_stats)

    def add(self, record: TransferRecord) -> None:
        with self.lock:
            old = self._records.get(record.req_id)
            if old is not None:
                what = "live" if not old.state.is_terminal else "finished (forget it first)"
                raise ValueError(f"transfer {record.req_id!r} already exists and is {what}")
            self._records[record.req_id] = record

    def get(self, req_id: str) -> TransferRecord | None:
        return self._records.get(req_id)  # one dict read is atomic: no lock on the hot path

    def live(self) -> list[TransferRecord]:
        with self.lock:
            return [r for r in self._records.values() if not r.state.is_terminal]

    def status(self, req_id: str) -> TransferStatus | None:
        with self.lock:
            record = self._records.get(req_id)
            return None if record is None else record.status()

    def mark_started(self, record: TransferRecord) -> None:
        """PENDING -> TRANSFERRING (a terminal state is left alone)."""
        with self.lock:
            if record.state is TransferState.PENDING:
                record.state = TransferState.TRANSFERRING
                record.started = record.started or time.monotonic()

    def forget(self, req_id: str) -> TransferStatus | None:
        with self.lock:
            record = self._records.get(req_id)
            if record is None:
                return None
            if not record.state.is_terminal:
                raise ValueError(f"transfer {req_id!r} is still {record.state.value}; abort it first")
            del self._records[req_id]
            return record.status()

    def finish(
        self,
        record: TransferRecord,
        state: TransferState,
        reason: FailReason | None = None,
        side: Side | None = None,
        detail: str = "",
        *,
        unless_ending: bool = False,
        num_bytes: int = 0,
    ) -> bool:
        """Move ``record`` to a terminal state; False when it already was terminal (or, with
        ``unless_ending``, is being ended: ``record.cancel`` is set). ``num_bytes``: what a
        DONE transfer moved in all, when the caller knows it better than the progress."""
        with record.io_lock, self.lock:
            if record.state.is_terminal or (unless_ending and record.cancel is not None):
                return False
            record.state = state
            end_time, now = time.time(), time.monotonic()  # the moment it ended
            record.reason, record.failed_side, record.detail = reason, side, detail
            if state is TransferState.DONE:
                record.num_done = record.num_total
                record.num_bytes = max(record.num_bytes, num_bytes)
            started = record.started if record.started is not None else now
            self._stats.append(
                TransferStats(
                    req_id=record.req_id,
                    role=self.role,
                    topology=record.topology or TopologyClass.SAME_NODE,
                    backend=record.backend,
                    state=state,
                    num_blocks=record.num_done,
                    num_skipped_blocks=len(record.present),
                    num_bytes=record.num_bytes,
                    queued_s=started - record.created,
                    duration_s=now - started,
                    end_time=end_time,
                )
            )
            return True

    def drain_stats(self) -> list[TransferStats]:
        with self.lock:
            out = list(self._stats)
            self._stats.clear()
            return out

    def overdue(self, config: TransferConfig) -> list[TransferRecord]:
        """Live records past a deadline: nothing heard of them (no block, no keepalive)
        within the start timeout while PENDING or the stall timeout since, or (ending,
        receives still posted) no release from the producer within the stall timeout."""
        now = time.monotonic()
        with self.lock:
            return [
                r
                for r in self._records.values()
                if not r.state.is_terminal and (
                    (r.cancel is not None and now - r.cancel_since > config.stall_timeout_s)
                    or (r.cancel is None and r.state is TransferState.PENDING
                        and now - r.last_alive > config.start_timeout_s)
                    or (r.cancel is None and r.state is TransferState.TRANSFERRING
                        and now - r.last_alive > config.stall_timeout_s))
            ]


def keepalive_interval_s(config: TransferConfig) -> float:
    """How often a producer tells its consumer that a transfer it vouches for is alive:
    four times within the shorter timeout, so that a late or lost one is no failure."""
    return min(config.stall_timeout_s, config.start_timeout_s) / 4


class Watchdog:
    """One thread per endpoint that fails transfers past their timeouts, and calls
    ``on_tick`` every round (the consumer checks its supervised threads there). A record
    whose handler raises is logged and tried again next round: nothing ends this thread."""

    def __init__(self, table: TransferTable, config: TransferConfig, on_overdue: Any,
                 on_tick: Any = None) -> None:
        self._table, self._config, self._on_overdue = table, config, on_overdue
        self._on_tick = on_tick
        self._stop = threading.Event()
        interval = min(config.stall_timeout_s, config.start_timeout_s) / 5
        self._interval = max(0.01, min(0.5, interval))
        self._thread = threading.Thread(target=self._run, name="kvx-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._round()
            except Exception:
                log.exception("kvtransfer watchdog: a round failed")

    def _round(self) -> None:
        if self._on_tick is not None:
            self._on_tick()
        for record in self._table.overdue(self._config):
            # A record whose blocks are being written right now is checked next round
            # (that receive has its own timeout); others are not held up behind it.
            if record.io_lock.acquire(blocking=False):
                try:
                    self._on_overdue(record)
                finally:
                    record.io_lock.release()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(offset, first_id, length)`` for each run of consecutive ids (pools hand out runs)."""
    runs: list[tuple[int, int, int]] = []
    for offset, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            off, first, length = runs[-1]
            runs[-1] = (off, first, length + 1)
        else:
            runs.append((offset, block, 1))
    return runs

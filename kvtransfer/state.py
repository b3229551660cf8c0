"""Transfer states, failure reasons, configuration and the stats record.

Everything a caller polls or consumes is a frozen value here; the mutable per-transfer record
lives in :mod:`kvtransfer.transfers`. Where an endpoint lives (``KVLocation``) and how far a
block travels between two (``TopologyClass``, by ``KVLocation.topology_to``) are the
scheduler's own types (``scheduler.messages``, ``scheduler.topology``): one rule, so the
class a measured transfer reports is the class the kernel priced it by.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from scheduler.messages import KVLocation
from scheduler.topology import TopologyClass

__all__ = ["FailReason", "KVLocation", "Side", "TopologyClass", "TransferConfig",
           "TransferState", "TransferStats", "TransferStatus"]


class TransferState(enum.Enum):
    PENDING = "pending"  # known on this side, no block moved yet
    TRANSFERRING = "transferring"  # at least one group on the wire
    DONE = "done"  # consumer wrote every expected block (producer: consumer acknowledged)
    FAILED = "failed"  # see TransferStatus.reason / failed_side
    ABORTED = "aborted"  # either side called abort()

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset((TransferState.DONE, TransferState.FAILED, TransferState.ABORTED))


class Side(enum.Enum):
    PRODUCER = "producer"
    CONSUMER = "consumer"


class FailReason(enum.Enum):
    TIMEOUT = "timeout"  # no progress within the configured timeout
    PEER_LOST = "peer_lost"  # the other process closed or died
    UNKNOWN_REQUEST = "unknown_request"  # consumer has no live reservation for the id
    MISMATCH = "mismatch"  # metadata disagrees with the reservation (count, dtype, shape)
    CHECKSUM = "checksum"  # payload does not match its checksum
    CONNECT_FAILED = "connect_failed"  # the pair group could not be built
    PROTOCOL = "protocol"  # malformed message; the pair is torn down
    LOCAL_ERROR = "local_error"  # reading or writing the pool raised


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Timeouts and message sizes; the same on both sides of a pair (the consumer's
    ``part_bytes`` sets the segment size, see :mod:`kvtransfer.plan`; the producer's
    ``checksum`` picks the announced path)."""

    stall_timeout_s: float = 10.0  # TRANSFERRING with no progress this long: FAILED
    start_timeout_s: float = 120.0  # PENDING this long (prefill never started): FAILED
    connect_timeout_s: float = 30.0  # building the pair's process group
    part_bytes: int = 8 << 20  # one message carries at most this (one segment of slots)
    max_in_flight_parts: int = 4  # sends a pair keeps in flight (and staging buffers)
    checksum: bool = False  # crc32 per segment, checked before DONE (announced path)
    # Hellos the consumer's accept queue may hold; past it the oldest are dropped unread
    # (refused, counted): a flood of them costs a pop each, never a pair.
    max_pending_hellos: int = 64

    def __post_init__(self) -> None:
        for name in ("stall_timeout_s", "start_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"TransferConfig.{name} must be a positive number, got {value!r}")
        for name in ("part_bytes", "max_in_flight_parts", "max_pending_hellos"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TransferConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class TransferStatus:
    """What ``poll`` answers: the state and, once it failed, why and whose fault."""

    state: TransferState
    reason: FailReason | None = None
    failed_side: Side | None = None
    detail: str = ""
    num_blocks_done: int = 0  # consumer: written; producer: sent
    num_blocks_total: int = 0  # blocks that travel (prefix hits at the consumer excluded)


@dataclass(frozen=True, slots=True)
class TransferStats:
    """One finished transfer, for metrics and the scheduler's cost model."""

    req_id: str
    role: Side  # which side recorded it
    topology: TopologyClass
    backend: str  # "gloo" | "nccl" | "mock"
    state: TransferState
    num_blocks: int  # blocks moved
    num_skipped_blocks: int  # prefix hits at the consumer, not sent
    num_bytes: int
    queued_s: float  # from expect()/begin() to the first block on the wire
    duration_s: float  # from the first block on the wire to the end
    end_time: float  # time.time() at the end

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.duration_s / 1e9 if self.duration_s > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "req_id": self.req_id,
            "role": self.role.value,
            "topology": self.topology.value,
            "backend": self.backend,
            "state": self.state.value,
            "num_blocks": self.num_blocks,
            "num_skipped_blocks": self.num_skipped_blocks,
            "num_bytes": self.num_bytes,
            "queued_s": self.queued_s,
            "duration_s": self.duration_s,
            "end_time": self.end_time,
        }


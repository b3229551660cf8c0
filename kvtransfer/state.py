"""Transfer states, failure reasons, topology classes, configuration and the stats record.

Everything a caller polls or consumes is a frozen value here; the mutable per-transfer record
lives in :mod:`kvtransfer.transfers`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


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


class TopologyClass(enum.Enum):
    """Where the bytes go, cheapest first (DESIGN §6)."""

    SAME_DEVICE = "same_device"
    SAME_NVLINK_DOMAIN = "same_nvlink_domain"
    SAME_NODE = "same_node"
    CROSS_NODE = "cross_node"


@dataclass(frozen=True, slots=True)
class Location:
    """Where a worker's KV pool lives. ``host`` is the address peers reach its endpoint at."""

    node_id: str
    device: str = "cpu"  # "cpu", "cuda:0", ...
    nvlink_domain: str | None = None
    host: str = "127.0.0.1"

    def topology_to(self, other: Location) -> TopologyClass:
        if self.node_id != other.node_id:
            return TopologyClass.CROSS_NODE
        if self.device == other.device:
            return TopologyClass.SAME_DEVICE
        if self.nvlink_domain is not None and self.nvlink_domain == other.nvlink_domain:
            return TopologyClass.SAME_NVLINK_DOMAIN
        return TopologyClass.SAME_NODE

    def to_wire(self) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "device": self.device,
            "nvlink_domain": self.nvlink_domain,
            "host": self.host,
        }

    @classmethod
    def from_wire(cls, wire: object) -> Location:
        if not isinstance(wire, dict):
            raise ValueError(f"location must be a dict, got {type(wire).__name__}")
        node_id, device = wire.get("node_id"), wire.get("device")
        domain, host = wire.get("nvlink_domain"), wire.get("host")
        if not isinstance(node_id, str) or not isinstance(device, str) or not isinstance(host, str):
            raise ValueError(f"location needs str node_id, device and host: {wire!r}")
        if domain is not None and not isinstance(domain, str):
            raise ValueError(f"location nvlink_domain must be a str or None: {domain!r}")
        return cls(node_id=node_id, device=device, nvlink_domain=domain, host=host)


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

    def __post_init__(self) -> None:
        for name in ("stall_timeout_s", "start_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"TransferConfig.{name} must be a positive number, got {value!r}")
        for name in ("part_bytes", "max_in_flight_parts"):
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


"""Per-worker KV block accounting: the model the simulator and the invariants share.

A worker has ``num_total_blocks``. Each block is free, cached (a prefix block no
live request owns, evictable) or owned by one request. Allocation is
all-or-nothing (``allocate`` returns False and changes nothing when the blocks
are not there); a request that ends returns its blocks, optionally leaving some
behind as cached prefix blocks. Decisions read ``num_free``/``num_cached``;
whoever owns the mechanism (a worker, the simulator) applies them here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class KVBlockAccount:
    worker_id: str
    num_total_blocks: int
    num_cached: int = 0
    owned: dict[str, int] = field(default_factory=dict)
    num_owned: int = 0

    def __post_init__(self) -> None:
        if self.num_total_blocks <= 0:
            raise ValueError(f"num_total_blocks: must be positive, got {self.num_total_blocks}")

    @property
    def num_free(self) -> int:
        return self.num_total_blocks - self.num_owned - self.num_cached

    @property
    def num_used(self) -> int:
        """Blocks not free: owned by requests or held as cached prefix blocks."""
        return self.num_owned + self.num_cached

    @property
    def mem_pressure(self) -> float:
        return self.num_owned / self.num_total_blocks

    def can_allocate(self, num_blocks: int, *, use_cached: bool = True) -> bool:
        avail = self.num_free + (self.num_cached if use_cached else 0)
        return num_blocks <= avail

    def allocate(self, req_id: str, num_blocks: int) -> bool:
        """Give ``req_id`` ``num_blocks`` more blocks, evicting cached ones if needed."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks: must be >= 0, got {num_blocks}")
        if not self.can_allocate(num_blocks):
            return False
        short = num_blocks - self.num_free
        if short > 0:
            self.num_cached -= short
        self.owned[req_id] = self.owned.get(req_id, 0) + num_blocks
        self.num_owned += num_blocks
        return True

    def release(self, req_id: str, *, keep_cached: int = 0) -> int:
        """Return all of ``req_id``'s blocks; ``keep_cached`` of them stay as prefix cache."""
        n = self.owned.pop(req_id, 0)
        self.num_owned -= n
        kept = min(max(keep_cached, 0), n)
        self.num_cached += kept
        return n

    def evict_cached(self, num_blocks: int) -> int:
        n = min(num_blocks, self.num_cached)
        self.num_cached -= n
        return n

    def blocks_of(self, req_id: str) -> int:
        return self.owned.get(req_id, 0)

"""The host swap space of one engine: a budget in blocks that swap-outs draw from.

A swapped request's KV sits in host memory (pinned on CUDA) until it is swapped back in,
recomputed or dropped. Without a bound a worker under pressure could swap until the host
runs out of memory, so the space has a capacity, in blocks and/or bytes (the smaller
wins; neither: unbounded, the engine's default outside the cluster). A swap-out that
does not fit is refused before anything is copied: ``LLMEngine.swap_out`` returns False
and the caller chooses another mode (the scheduler's victims are priced with the room
left, so a full space makes it choose migrate or recompute).

Every block taken is given back exactly once (swap-in, recompute of a swapped request,
abort); ``num_used`` is therefore the swapped blocks now, and ``num_peak`` the most at
once since the engine started (what the pressure bench reports against the budget).
"""

from __future__ import annotations


class SwapSpace:
    def __init__(self, *, num_blocks: int | None = None, num_bytes: int | None = None,
                 bytes_per_block: int = 1) -> None:
        limits = []
        if num_blocks is not None:
            limits.append(num_blocks)
        if num_bytes is not None:
            limits.append(num_bytes // max(bytes_per_block, 1))
        if any(n < 0 for n in limits):
            raise ValueError(f"a swap space cannot hold a negative number of blocks: {limits}")
        self.capacity: int | None = min(limits) if limits else None
        self.num_used = 0
        self.num_peak = 0

    @property
    def num_free(self) -> int | None:
        """Blocks that still fit (None: unbounded)."""
        return None if self.capacity is None else self.capacity - self.num_used

    def can_hold(self, num_blocks: int) -> bool:
        return self.capacity is None or self.num_used + num_blocks <= self.capacity

    def take(self, num_blocks: int) -> None:
        if not self.can_hold(num_blocks):
            raise ValueError(f"swap space full: {num_blocks} blocks asked, "
                             f"{self.num_free} free of {self.capacity}")
        self.num_used += num_blocks
        self.num_peak = max(self.num_peak, self.num_used)

    def give(self, num_blocks: int) -> None:
        if num_blocks > self.num_used:
            raise ValueError(f"swap space: {num_blocks} blocks given back, {self.num_used} in use")
        self.num_used -= num_blocks

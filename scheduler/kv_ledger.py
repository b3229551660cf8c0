"""What a decode worker measured of its KV moves and restores, for its ``KVMemoryReport``.

The worker core records each swap, migration and restore here as it happens; the report
takes them (and the engine's swap space and prefix counters, which the applier reads)
and starts a fresh list. The kernel's link model learns from the samples, the metrics
from the restores.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.messages import KVMemoryReport, LinkKind, LinkSample, PreemptMode, RestoreStat


@dataclass(frozen=True, slots=True)
class KVCounters:
    """The engine's figures a report carries: swap space and prefix-cache counters."""

    num_swap_blocks: int | None = None
    num_swap_used: int = 0
    num_swap_peak: int = 0
    num_prefix_query_blocks: int = 0
    num_prefix_hit_blocks: int = 0


class MemoryLedger:
    """Measured moves and restores since the last report."""

    def __init__(self, bytes_per_block: int) -> None:
        self.bytes_per_block = bytes_per_block
        self._samples: list[LinkSample] = []
        self._restores: list[RestoreStat] = []
        self.num_restores: dict[str, int] = {}

    def moved(self, num_bytes: int, seconds: float, peer_worker_id: str) -> None:
        self._samples.append(LinkSample(LinkKind.MOVE, num_bytes, seconds, peer_worker_id))

    def swapped(self, kind: LinkKind, num_blocks: int, seconds: float) -> None:
        self._samples.append(LinkSample(kind, num_blocks * self.bytes_per_block, seconds))

    def restored(self, req_id: str, mode: PreemptMode, seconds: float, from_worker_id: str = "",
                 *, num_cached_tokens: int = 0) -> None:
        self._restores.append(RestoreStat(req_id, mode, seconds, from_worker_id,
                                          num_cached_tokens))
        self.num_restores[mode.value] = self.num_restores.get(mode.value, 0) + 1

    def report(self, c: KVCounters) -> KVMemoryReport:
        out = KVMemoryReport(c.num_swap_blocks, c.num_swap_used, c.num_swap_peak,
                             c.num_prefix_query_blocks, c.num_prefix_hit_blocks,
                             tuple(self._samples), tuple(self._restores))
        self._samples, self._restores = [], []
        return out

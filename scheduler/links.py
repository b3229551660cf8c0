"""What moving KV blocks costs, as the workers measure it (DESIGN §6).

The kernel prices a preemption victim by the restore it would need: its blocks back
over the host link (swap), across to another worker of some topology class and decoding
on there (migrate), or computed again (recompute, priced by the workers' fitted step
costs, :mod:`scheduler.step_costs`). :class:`~scheduler.topology.LinkCosts` holds a
device's prior figures; :class:`LinkModel` starts from them and replaces each link's
bandwidth with what the workers observe (``scheduler.messages.LinkSample``): every swap
they time (the host link) and every migration (a move between two workers, whose class
the kernel reads off the two workers' locations). A prefill's streamed transfer is not a
sample: its time is the prefill's, not the link's.

Data flow::

    worker times a swap or a migration ──LinkSample in its WorkerReport──▶
    ClusterScheduler.on_report ──observe_swap / observe_move(cls, ...)──▶ LinkModel
    policy prices a victim ──swap_s(n) / move_s(n, cls)──▶ measured figures (prior until
    the first sample of that link)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from scheduler.topology import LinkCosts, TopologyClass


class LinkPricer(Protocol):
    """What a policy reads of link costs (:class:`LinkCosts` and :class:`LinkModel` fit)."""

    @property
    def bytes_per_block(self) -> int: ...

    def move_s(self, num_blocks: int, cls: TopologyClass) -> float: ...

    def swap_s(self, num_blocks: int) -> float: ...


@dataclass(slots=True)
class LinkEstimate:
    """One link's bandwidth: the prior until measured, then a moving average of samples."""

    bw: float  # bytes per second
    latency_s: float
    num_samples: int = 0

    def observe(self, num_bytes: int, seconds: float, alpha: float) -> None:
        # The fixed latency is the prior's; the rest of the time is the bytes' (at least a
        # tenth of it, so a sample near the latency does not read as infinite bandwidth).
        busy = max(seconds - self.latency_s, 0.1 * seconds)
        bw = num_bytes / busy
        self.bw = bw if self.num_samples == 0 else self.bw + alpha * (bw - self.bw)
        self.num_samples += 1

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bw


class LinkModel:
    """Measured link costs; a :class:`LinkPricer` (see the module docstring)."""

    # Weight of a new sample: a few migrations are enough to move off a wrong prior.
    ALPHA = 0.3
    # Samples below this many bytes say more about the fixed costs than the bandwidth.
    MIN_SAMPLE_BYTES = 64 << 10

    def __init__(self, prior: LinkCosts) -> None:
        self.prior = prior
        self.links = {cls: LinkEstimate(prior.bw[cls], prior.latency[cls])
                      for cls in TopologyClass}
        self.host = LinkEstimate(prior.host_bw, prior.host_latency)

    @property
    def bytes_per_block(self) -> int:
        return self.prior.bytes_per_block

    def move_s(self, num_blocks: int, cls: TopologyClass) -> float:
        if num_blocks <= 0:
            return 0.0
        return self.links[cls].seconds(num_blocks * self.bytes_per_block)

    def swap_s(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        return self.host.seconds(num_blocks * self.bytes_per_block)

    def observe_move(self, cls: TopologyClass, num_bytes: int, seconds: float) -> None:
        if num_bytes >= self.MIN_SAMPLE_BYTES and seconds > 0:
            self.links[cls].observe(num_bytes, seconds, self.ALPHA)

    def observe_swap(self, num_bytes: int, seconds: float) -> None:
        if num_bytes >= self.MIN_SAMPLE_BYTES and seconds > 0:
            self.host.observe(num_bytes, seconds, self.ALPHA)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Each link's bandwidth now (GB/s) and how many samples made it (stats, benches)."""
        out = {cls.value: {"gbps": e.bw / 1e9, "num_samples": float(e.num_samples)}
               for cls, e in self.links.items()}
        out["host"] = {"gbps": self.host.bw / 1e9, "num_samples": float(self.host.num_samples)}
        return out

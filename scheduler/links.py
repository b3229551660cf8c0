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
    """One link: time = latency + bytes / bandwidth, the prior's figures until measured,
    then a least-squares fit of the recent samples (each weighs ``1 - alpha`` of the one
    after it). Samples of one size cannot separate the two terms: the latency then stays
    the prior's and the bandwidth takes the rest of the mean time. Samples of several
    sizes whose time grows no faster than the prior's bandwidth say the link's cost is
    fixed: the bandwidth stays the prior's and the latency takes the rest."""

    bw: float  # bytes per second
    latency_s: float
    num_samples: int = 0
    _prior_bw: float = -1.0
    # Decayed sums of the samples (weights, bytes, seconds, bytes^2, bytes x seconds).
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    _prior_latency_s: float = -1.0

    def observe(self, num_bytes: int, seconds: float, alpha: float) -> None:
        if self._prior_latency_s < 0:
            self._prior_latency_s, self._prior_bw = self.latency_s, self.bw
        keep = 1.0 - alpha
        x, y = float(num_bytes), float(seconds)
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + x
        self._y = self._y * keep + y
        self._xx = self._xx * keep + x * x
        self._xy = self._xy * keep + x * y
        self.num_samples += 1
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        sizes_vary = var > (0.1 * mx) ** 2
        slope = (self._xy / self._w - mx * my) / var if sizes_vary else 0.0
        latency = my - slope * mx
        if sizes_vary and slope <= 1.0 / self._prior_bw:
            # Several sizes, and time does not grow with size faster than the prior's
            # bandwidth says: a fixed cost dominates (a busy host's scheduling, not the
            # wire); spreading it over the bytes would price big moves far too high.
            latency = max(my - mx / self._prior_bw, 0.0)
            slope = 1.0 / self._prior_bw
        elif slope <= 0 or latency < 0:  # one size, or noise: keep the prior's latency
            latency = min(self._prior_latency_s, 0.9 * my)
            slope = (my - latency) / mx
        self.latency_s, self.bw = latency, 1.0 / slope

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bw


class LinkModel:
    """Measured link costs; a :class:`LinkPricer` (see the module docstring)."""

    # Weight of a new sample: a few migrations are enough to move off a wrong prior.
    ALPHA = 0.3

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
        if num_bytes > 0 and seconds > 0:
            self.links[cls].observe(num_bytes, seconds, self.ALPHA)

    def observe_swap(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.host.observe(num_bytes, seconds, self.ALPHA)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Each link's bandwidth (GB/s) and latency now, and how many samples made them."""
        out = {cls.value: _figures(e) for cls, e in self.links.items()}
        out["host"] = _figures(self.host)
        return out


def _figures(e: LinkEstimate) -> dict[str, float]:
    return {"gbps": e.bw / 1e9, "latency_ms": 1e3 * e.latency_s,
            "num_samples": float(e.num_samples)}


def prior_link_costs(bytes_per_block: int, device: str = "cuda") -> LinkCosts:
    """Prior link costs per topology class and of the host link, by device: the kernel's
    link model (scheduler.links) starts from these and moves to what the workers measure
    (every migration and swap they time). GPU: NVLink, PCIe and network figures; CPU:
    gloo over TCP between processes, a memory copy for a swap."""
    gb = 1e9
    if not device.startswith("cuda"):
        return LinkCosts(
            bytes_per_block=bytes_per_block,
            bw={TopologyClass.SAME_DEVICE: 4 * gb, TopologyClass.SAME_DOMAIN: 1.5 * gb,
                TopologyClass.SAME_NODE: 1.5 * gb, TopologyClass.CROSS_NODE: 1 * gb},
            latency={TopologyClass.SAME_DEVICE: 1e-4, TopologyClass.SAME_DOMAIN: 1e-3,
                     TopologyClass.SAME_NODE: 1e-3, TopologyClass.CROSS_NODE: 2e-3},
            host_bw=4 * gb, host_latency=1e-4)
    return LinkCosts(
        bytes_per_block=bytes_per_block,
        bw={TopologyClass.SAME_DEVICE: 500 * gb, TopologyClass.SAME_DOMAIN: 150 * gb,
            TopologyClass.SAME_NODE: 20 * gb, TopologyClass.CROSS_NODE: 10 * gb},
        latency={TopologyClass.SAME_DEVICE: 5e-6, TopologyClass.SAME_DOMAIN: 10e-6,
                 TopologyClass.SAME_NODE: 30e-6, TopologyClass.CROSS_NODE: 100e-6},
        host_bw=20 * gb,
    )

"""Buffers a pair reuses: pool runs as messages, staging for gathers and scatters, frames.

Segments are runs of consecutive slots on the consumer (kvtransfer.plan). A block-major pool
(kvtransfer.layout) holds a run as one contiguous region in the wire layout: the consumer
receives straight into it, and the producer sends a segment straight from its pool when the
segment's source blocks are consecutive too (:meth:`PoolView.run`) and otherwise gathers them
into a reused :class:`Slab` first. A layer-major pool holds a block as ``num_layers * 2``
pieces, so every segment goes through a slab: the producer gathers its source blocks into one
in the wire layout (:meth:`PoolView.gather`: one strided copy for consecutive sources, one
``index_select`` otherwise), the consumer receives into one and scatters it into the slots
(:meth:`PoolView.scatter`: one strided copy, the slots of a segment are consecutive). Frames
carry the fwd control messages on channels that keep a receive posted.

Why reuse: a small transfer's latency is mostly fixed per-call costs, so the hot path
allocates nothing and makes no view it can cache; block-major host pools are gathered with
numpy through a byte view of the same memory (one ``take`` call for any ids), device pools
and layer-major pools with torch (the same ops on a host and a device).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtransfer import wire
from kvtransfer.layout import KVLayout, is_block_major
from kvtransfer.transfers import block_runs

_MAX_CACHED_VIEWS = 64  # per slab; block counts per segment are few in practice


class Slab:
    """One contiguous staging buffer of ``capacity_blocks`` blocks on the pool's device."""

    __slots__ = ("tensor", "capacity_blocks", "_layout", "_host", "_messages", "_pieces")

    def __init__(self, layout: KVLayout, capacity_blocks: int) -> None:
        self._layout = layout
        self.capacity_blocks = capacity_blocks
        self.tensor = torch.empty(capacity_blocks * layout.bytes_per_block, dtype=torch.uint8,
                                  device=layout.device)
        self._host: np.ndarray | None = None
        if self.tensor.device.type == "cpu":
            self._host = self.tensor.numpy().reshape(capacity_blocks, layout.bytes_per_block)
        self._messages: dict[int, torch.Tensor] = {}
        self._pieces: torch.Tensor | None = None

    def message(self, n: int) -> torch.Tensor:
        """The first ``n`` blocks as the uint8 tensor that is sent."""
        view = self._messages.get(n)
        if view is None:
            if len(self._messages) >= _MAX_CACHED_VIEWS:
                self._messages.clear()
            view = self._messages[n] = self.tensor[: n * self._layout.bytes_per_block]
        return view

    def host_blocks(self) -> np.ndarray | None:
        """``[capacity_blocks, bytes_per_block]`` uint8 view in host memory (None on a device)."""
        return self._host

    def pieces(self, n: int) -> torch.Tensor:
        """The first ``n`` blocks as ``[n, num_layers * 2, piece bytes]`` uint8: the wire
        layout, cut where a layer-major pool cuts a block."""
        pieces = self._pieces
        if pieces is None:
            pieces = self._pieces = self.tensor.view(
                self.capacity_blocks, 2 * self._layout.num_layers, -1)
        return pieces[:n]


class SlabPool:
    """Free staging slabs of one size (a whole segment each); take and give are safe from
    several threads (a consumer's waiters share one pool)."""

    def __init__(self, layout: KVLayout, capacity_blocks: int) -> None:
        self._layout, self._capacity = layout, capacity_blocks
        self._free: list[Slab] = []

    def take(self) -> Slab:
        try:
            return self._free.pop()  # atomic: no check-then-pop race between threads
        except IndexError:
            return Slab(self._layout, self._capacity)

    def give(self, slab: Slab) -> None:
        self._free.append(slab)


class PoolView:
    """Runs of a store's pool tensor as messages, gathers of blocks into slabs, and (layer-major
    pools) scatters of slabs into runs of slots."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.block_major = is_block_major(store)
        self._kv: torch.Tensor | None = None
        self._host: np.ndarray | None = None
        # layer-major: (the pool tensor, its [num_layers * 2, num_blocks, piece bytes] uint8
        # view), one attribute so that threads never see the one without the other
        self._pieces: tuple[torch.Tensor, torch.Tensor] | None = None

    def _pool(self) -> torch.Tensor:
        kv = self._store.kv_tensor()
        if kv is not self._kv:
            self._kv, self._host = kv, _host_blocks(kv)
        return kv

    def _layer_pieces(self) -> torch.Tensor:
        kv = self._store.kv_tensor()
        cached = self._pieces
        if cached is None or cached[0] is not kv:
            cached = self._pieces = (kv, kv.view(torch.uint8).view(kv.shape[0] * 2,
                                                                   kv.shape[2], -1))
        return cached[1]

    def run(self, first: int, n: int) -> torch.Tensor:
        """Blocks ``first .. first + n - 1``: one contiguous region, sent or received as is
        (block-major pools only)."""
        kv = self._kv
        return (kv if kv is not None else self._pool()).narrow(0, first, n)

    def gather(self, block_ids: Sequence[int], slab: Slab) -> torch.Tensor:
        """Copy the blocks into the slab, in order, in the wire layout; returns the message."""
        n = len(block_ids)
        if not self.block_major:
            pieces, out = self._layer_pieces(), slab.pieces(n)
            first = block_ids[0]
            if list(block_ids) == list(range(first, first + n)):
                out.copy_(pieces.narrow(1, first, n).transpose(0, 1))
            else:
                index = torch.tensor(block_ids, dtype=torch.long, device=pieces.device)
                torch.index_select(pieces.transpose(0, 1), 0, index, out=out)
            return slab.message(n)
        kv = self._pool()
        host = slab.host_blocks()
        if self._host is not None and host is not None:
            np.take(self._host, block_ids, axis=0, out=host[:n])
        else:
            out = slab.message(n).view(kv.dtype).view(n, *kv.shape[1:])
            for off, first, length in block_runs(block_ids):
                out.narrow(0, off, length).copy_(kv.narrow(0, first, length))
        return slab.message(n)

    def scatter(self, slab: Slab, first: int, n: int) -> None:
        """Copy the slab's first ``n`` blocks into slots ``first .. first + n - 1`` of a
        layer-major pool (a block-major pool receives straight into :meth:`run`)."""
        self._layer_pieces().narrow(1, first, n).copy_(slab.pieces(n).transpose(0, 1))


def _host_blocks(kv: torch.Tensor) -> np.ndarray | None:
    """The host pool as ``[num_blocks, bytes_per_block]`` uint8 (None on a device)."""
    if kv.device.type != "cpu" or not kv.is_contiguous():
        return None
    try:
        return kv.detach().view(torch.uint8).numpy().reshape(kv.shape[0], -1)
    except (RuntimeError, TypeError):
        return None


def crc32(tensor: torch.Tensor) -> int:
    """crc32 of a contiguous tensor's bytes (device tensors are copied to the host)."""
    data = tensor.detach().contiguous().view(torch.uint8).reshape(-1).cpu().numpy()
    return zlib.crc32(memoryview(data))


class Frame:
    """A host uint8 buffer of ``wire.FRAME_BYTES`` and a byte view of it (no torch op to
    write or read a message)."""

    __slots__ = ("tensor", "view")

    def __init__(self) -> None:
        self.tensor = torch.zeros(wire.FRAME_BYTES, dtype=torch.uint8)
        self.view = memoryview(self.tensor.numpy())


class FramePool:
    def __init__(self) -> None:
        self._free: list[Frame] = []

    def take(self) -> Frame:
        return self._free.pop() if self._free else Frame()

    def give(self, frame: Frame) -> None:
        self._free.append(frame)

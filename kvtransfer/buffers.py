"""Reused staging and frame buffers, and the views every transfer needs, made once.

A :class:`Slab` is one contiguous uint8 buffer ``[head bytes | payload]`` (``head`` is
``wire.FRAME_HEADER_BYTES`` for a frame, 0 for a plain staging part). It caches the views a
transfer uses: the message prefix handed to the channel, the blocks it holds, and in host
memory a memoryview of its header bytes and a numpy view of the whole buffer.

Why: a small transfer's latency is mostly fixed per-call costs, and after an idle spell
(every transfer starts after one) a torch op costs tens of microseconds in dispatch before
it touches a byte. So the hot path builds no torch view, writes and reads frame headers as
bytes, and on host memory copies blocks with numpy (:class:`PoolView`): same memory, a far
shorter call path. Device pools keep torch copies. Slabs never shrink or move, so cached
views stay valid for the slab's life.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtransfer.layout import KVLayout
from kvtransfer.transfers import gather_blocks, scatter_blocks

_MAX_CACHED_VIEWS = 64  # per slab and kind; block counts per part are few in practice


class Slab:
    __slots__ = ("tensor", "head", "header", "_host", "_layout", "_groups", "_messages")

    def __init__(self, tensor: torch.Tensor, head: int, layout: KVLayout) -> None:
        self.tensor = tensor
        self.head = head
        self._layout = layout
        # Where wire.write_frame_header / read_frame_header work: the head bytes as a
        # memoryview in host memory (frames travel on gloo and mock), else the tensor itself.
        self._host: np.ndarray | None = tensor.numpy() if tensor.device.type == "cpu" else None
        self.header: memoryview | torch.Tensor = (
            memoryview(self._host)[:head] if self._host is not None else tensor)
        self._groups: dict[int, Any] = {}
        self._messages: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    @property
    def capacity(self) -> int:
        """Payload bytes this slab can hold."""
        return self.tensor.numel() - self.head

    def group(self, n: int) -> Any:
        """The payload's first ``n`` blocks as the copies see them (:class:`PoolView`): in
        host memory a numpy byte view ``[layers, 2, n, block_size, heads, head_dim *
        itemsize]``, else :meth:`tensor_group`."""
        view = self._groups.get(n)
        if view is None:
            if self._host is not None:
                nbytes = n * self._layout.bytes_per_block
                view = self._host[self.head:self.head + nbytes].reshape(
                    _byte_shape(self._layout, n))
            else:
                view = self.tensor_group(n)
            _remember(self._groups, n, view)
        return view

    def tensor_group(self, n: int) -> torch.Tensor:
        """The payload's first ``n`` blocks as a tensor ``[layers, 2, n, *block_shape]``."""
        nbytes = n * self._layout.bytes_per_block
        return (self.tensor[self.head:self.head + nbytes].view(self._layout.dtype)
                .view(self._layout.group_shape(n)))

    def message(self, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """What travels: the head and the payload's first ``nbytes`` (``dtype`` only for a
        slab without head, whose payload is sent as the pool's element type)."""
        key = (nbytes, dtype)
        view = self._messages.get(key)
        if view is None:
            view = self.tensor[: self.head + nbytes]
            if dtype is not torch.uint8:
                view = view.view(dtype)
            _remember(self._messages, key, view)
        return view

    def payload(self, nbytes: int) -> torch.Tensor:
        """The payload's first ``nbytes`` as uint8 (checksums)."""
        return self.tensor[self.head:self.head + nbytes]


def _byte_shape(layout: KVLayout, n: int) -> tuple[int, ...]:
    *lead, last = layout.group_shape(n)
    return (*lead, last * layout.dtype.itemsize)


def _remember(cache: dict, key: object, view: Any) -> None:
    if len(cache) >= _MAX_CACHED_VIEWS:
        cache.clear()
    cache[key] = view


class PoolView:
    """Block copies between a store's pool tensor and slabs.

    Host pools are copied through a numpy byte view of the pool (made once per pool tensor),
    device pools (and a host pool whose elements cannot be viewed as bytes) with torch."""

    def __init__(self, store: Any, layout: KVLayout) -> None:
        self._store, self._layout = store, layout
        self._kv: torch.Tensor | None = None
        self._view: Any = None

    def _pool(self) -> Any:
        kv = self._store.kv_tensor()
        if kv is not self._kv:
            self._kv, self._view = kv, _host_bytes(kv)
        return self._view if self._view is not None else kv

    def gather(self, block_ids: Sequence[int], slab: Slab) -> None:
        """The source blocks ``block_ids`` into the slab's payload."""
        kv = self._pool()
        gather_blocks(kv, block_ids, _like(kv, slab, len(block_ids)))

    def scatter(self, block_ids: Sequence[int], slab: Slab) -> None:
        """The blocks in the slab's payload into the pool's slots ``block_ids``."""
        kv = self._pool()
        scatter_blocks(kv, block_ids, _like(kv, slab, len(block_ids)))


def _host_bytes(kv: torch.Tensor) -> np.ndarray | None:
    if kv.device.type != "cpu" or kv.stride(-1) != 1:
        return None
    try:
        return kv.detach().view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None


def _like(kv: Any, slab: Slab, n: int) -> Any:
    """The slab's blocks in the same kind as the pool view (numpy or torch)."""
    if isinstance(kv, np.ndarray):
        return slab.group(n)
    return slab.tensor_group(n)


class SlabPool:
    """Free slabs of one kind (frames or staging parts) on the pool's device."""

    def __init__(self, layout: KVLayout, head: int, capacity: int) -> None:
        self._layout, self._head, self._capacity = layout, head, capacity
        self._free: list[Slab] = []

    def take(self, nbytes: int) -> Slab:
        """A slab whose payload holds at least ``nbytes`` (reused when one is free)."""
        while self._free:
            slab = self._free.pop()
            if slab.capacity >= nbytes:
                return slab
        size = self._head + max(nbytes, self._capacity)
        tensor = torch.empty(size, dtype=torch.uint8, device=self._layout.device)
        return Slab(tensor, self._head, self._layout)

    def give(self, slab: Slab) -> None:
        self._free.append(slab)

"""The KV block layout kvtransfer moves, and the store interface it reads and writes through.

On the wire a block is always ``[num_layers, 2, block_size, num_kv_heads, head_dim]``, every
layer's K and V of its tokens, and ``n`` blocks are ``group_shape(n)`` with the blocks outermost.
A pool holds its blocks one of two ways (``KVStore.block_major``):

* block-major ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (the
  engine's ``BlockPool`` with paged attention, on CPU): a block is ``kv[block_id]``, the wire
  layout, so a run of consecutive blocks is one contiguous region and travels as one
  message, straight from the producer's pool and straight into the consumer's slots;
* layer-major ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (the
  engine's ``BlockPool`` with flex attention, the CUDA path: each layer's K, and V, of every
  block is one uniform-stride sequence; dim 2 may hold more blocks than the store hands out,
  as the engine's null block): a block is ``num_layers * 2`` pieces, one per layer and K/V, so
  every segment goes through a staging slab in the wire layout (gathered from the pool on the
  producer, scattered into the slots on the consumer, :mod:`kvtransfer.buffers`).

The two interoperate: either side may be either layout. :class:`KVStore` is the structural
interface the engine's block pool satisfies; :class:`TensorKVStore` is a plain pool tensor of
either layout with the same interface, for workers without an engine (benchmarks) and tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from scheduler.messages import KVPoolShape

# dtypes a KV cache may have; the wire names are torch's attribute names.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}


def dtype_to_wire(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype}") from None


def dtype_from_wire(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise ValueError(f"unknown KV dtype on the wire: {name!r}")
    return WIRE_DTYPES[name]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and placement of one worker's KV pool (the engine may return any object with
    these attributes; :meth:`of` converts it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        dtype_to_wire(self.dtype)

    @classmethod
    def of(cls, obj: Any) -> KVLayout:
        if isinstance(obj, KVLayout):
            return obj
        return cls(
            num_layers=int(obj.num_layers),
            num_kv_heads=int(obj.num_kv_heads),
            head_dim=int(obj.head_dim),
            block_size=int(obj.block_size),
            dtype=obj.dtype,
            device=torch.device(obj.device),
        )

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Per layer, per K or V: ``(block_size, num_kv_heads, head_dim)``."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    def group_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of ``num_blocks`` blocks on the wire and as read_blocks returns them (and as a
        block-major pool holds them)."""
        return (num_blocks, self.num_layers, 2, *self.block_shape)

    def pool_shape(self, num_blocks: int, *, block_major: bool = True) -> tuple[int, ...]:
        """Shape of a whole pool of ``num_blocks`` blocks in either layout."""
        if block_major:
            return self.group_shape(num_blocks)
        return (self.num_layers, 2, num_blocks, *self.block_shape)

    @property
    def bytes_per_block(self) -> int:
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * self.dtype.itemsize)

    def shape(self) -> KVPoolShape:
        """The geometry and dtype peers compare (the device is each side's own)."""
        return KVPoolShape(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, block_size=self.block_size,
                           dtype=dtype_to_wire(self.dtype))


@runtime_checkable
class KVStore(Protocol):
    """What kvtransfer needs from a worker's block pool.

    ``block_major`` says how ``kv_tensor``, the whole pool tensor, holds the blocks
    (contiguous either way): True, ``pool_shape(num_blocks)``; False (layer-major),
    ``pool_shape(num_blocks, block_major=False)``. A store without the attribute is
    block-major (read it with :func:`is_block_major`). kvtransfer reads and writes the pool
    tensor from its own threads and only for blocks the caller handed it (source blocks of a
    live transfer, reserved slots): in a block-major pool it sends runs of source blocks
    straight from it, receives straight into runs of reserved slots, and gathers scattered
    source blocks into reused staging buffers; in a layer-major pool it gathers every
    segment's source blocks into a staging buffer and scatters every received segment from
    one into its slots (one tensor op each). ``read_blocks`` (a contiguous copy) and
    ``write_blocks`` take and give ``group_shape(len(block_ids))`` in both layouts; they are
    for tests and swaps.
    """

    block_major: bool

    def kv_layout(self) -> Any: ...

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None: ...

    def kv_tensor(self) -> torch.Tensor: ...


def is_block_major(store: Any) -> bool:
    """The store's ``block_major`` flag (True when it has none: stores older than the flag)."""
    flag = getattr(store, "block_major", True)
    if not isinstance(flag, bool):
        raise ValueError(f"KVStore.block_major must be a bool, got {flag!r}")
    return flag


def check_pool(store: KVStore, layout: KVLayout) -> None:
    """The pool tensor must be one contiguous tensor of the layout's dtype, shaped as the
    store's ``block_major`` says: kvtransfer takes runs and gathers of it as they are."""
    block_major = is_block_major(store)
    kv = store.kv_tensor()
    if block_major:
        fits = kv.dim() == 6 and tuple(kv.shape[1:]) == layout.group_shape(1)[1:]
        want = f"block-major [num_blocks, {', '.join(map(str, layout.group_shape(1)[1:]))}]"
    else:
        per_layer = (layout.num_layers, 2)
        fits = (kv.dim() == 6 and tuple(kv.shape[:2]) == per_layer
                and tuple(kv.shape[3:]) == layout.block_shape)
        want = (f"layer-major [{layout.num_layers}, 2, num_blocks, "
                f"{', '.join(map(str, layout.block_shape))}]")
    if not fits or not kv.is_contiguous() or kv.dtype != layout.dtype:
        raise ValueError(f"the KV pool must be one contiguous {layout.dtype} tensor, {want} "
                         f"(the store says block_major={block_major}), got {kv.dtype} "
                         f"{tuple(kv.shape)}{'' if kv.is_contiguous() else ' (not contiguous)'}")


class TensorKVStore:
    """A bare pool tensor with the :class:`KVStore` interface (no allocator: callers own ids),
    block-major, or layer-major with ``layer_major=True``."""

    def __init__(self, layout: KVLayout, num_blocks: int, *, fill: str = "zeros",
                 layer_major: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._layout = layout
        self.num_blocks = num_blocks
        self.block_major = not layer_major
        shape = layout.pool_shape(num_blocks, block_major=self.block_major)
        if fill == "zeros":
            self._kv = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        elif fill == "random":
            self._kv = torch.randn(shape, device=layout.device).to(layout.dtype)
        else:
            raise ValueError(f"fill must be 'zeros' or 'random', got {fill!r}")

    def kv_layout(self) -> KVLayout:
        return self._layout

    def kv_tensor(self) -> torch.Tensor:
        return self._kv

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A contiguous copy ``group_shape(len(block_ids))`` of the blocks, in order."""
        if self.block_major:
            return self._kv.index_select(0, self._index(block_ids))
        return self._kv.index_select(2, self._index(block_ids)).permute(2, 0, 1, 3, 4, 5).contiguous()

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite the blocks with ``data`` (shape ``group_shape(len(block_ids))``)."""
        expected = self._layout.group_shape(len(block_ids))
        if tuple(data.shape) != expected:
            raise ValueError(f"write_blocks: data shape {tuple(data.shape)}, expected {expected}")
        if self.block_major:
            self._kv.index_copy_(0, self._index(block_ids), data)
        else:
            self._kv.index_copy_(2, self._index(block_ids), data.permute(1, 2, 0, 3, 4, 5))

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
        return torch.tensor(list(block_ids), dtype=torch.long, device=self._kv.device)

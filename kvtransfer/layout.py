"""The KV block layout kvtransfer moves, and the store interface it reads and writes through.

A block is ``kv[block_id]`` of the pool tensor ``[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim]`` (block-major, as the engine's ``BlockPool`` lays it out): every
layer's K and V of the block in one contiguous region, so a run of consecutive blocks is one
region and travels as one message. :class:`KVStore` is the structural interface the engine's
block pool satisfies; :class:`TensorKVStore` is a plain pool tensor with the same interface for
workers without an engine (benchmarks) and for tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

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
        """Shape of ``num_blocks`` blocks as read_blocks returns them (and the pool holds them)."""
        return (num_blocks, self.num_layers, 2, *self.block_shape)

    @property
    def bytes_per_block(self) -> int:
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * self.dtype.itemsize)

    def to_wire(self) -> dict[str, object]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "dtype": dtype_to_wire(self.dtype),
        }

    def matches_wire(self, wire: object) -> bool:
        """Same block geometry and dtype as a peer's ``to_wire`` (devices may differ)."""
        return isinstance(wire, dict) and wire == self.to_wire()


@runtime_checkable
class KVStore(Protocol):
    """What kvtransfer needs from a worker's block pool.

    ``kv_tensor`` is the whole pool tensor ``[num_blocks, *group_shape(1)[1:]]``, contiguous:
    kvtransfer sends runs of source blocks straight from it, receives straight into runs of
    reserved slots, and gathers scattered source blocks into reused staging buffers, from its
    own threads and only for blocks the caller handed it (source blocks of a live transfer,
    reserved slots). ``read_blocks`` (a contiguous copy) and ``write_blocks`` (shape
    ``group_shape(len(block_ids))``) are for tests and swaps.
    """

    def kv_layout(self) -> Any: ...

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None: ...

    def kv_tensor(self) -> torch.Tensor: ...


def check_pool(store: KVStore, layout: KVLayout) -> None:
    """The pool tensor must be block-major and contiguous: runs of it travel as they are."""
    kv = store.kv_tensor()
    if (kv.dim() != 6 or tuple(kv.shape[1:]) != layout.group_shape(1)[1:]
            or not kv.is_contiguous() or kv.dtype != layout.dtype):
        raise ValueError(f"the KV pool must be one contiguous {layout.dtype} tensor "
                         f"[num_blocks, {', '.join(map(str, layout.group_shape(1)[1:]))}], "
                         f"got {kv.dtype} {tuple(kv.shape)}"
                         f"{'' if kv.is_contiguous() else ' (not contiguous)'}")


class TensorKVStore:
    """A bare pool tensor with the :class:`KVStore` interface (no allocator: callers own ids)."""

    def __init__(self, layout: KVLayout, num_blocks: int, *, fill: str = "zeros") -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._layout = layout
        self.num_blocks = num_blocks
        shape = layout.group_shape(num_blocks)
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
        return self._kv.index_select(0, self._index(block_ids))

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        expected = self._layout.group_shape(len(block_ids))
        if tuple(data.shape) != expected:
            raise ValueError(f"write_blocks: data shape {tuple(data.shape)}, expected {expected}")
        self._kv.index_copy_(0, self._index(block_ids), data)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
        return torch.tensor(list(block_ids), dtype=torch.long, device=self._kv.device)

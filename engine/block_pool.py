"""The paged KV block pool of one device (DESIGN §3, contracts.md).

Layout: one preallocated tensor in the model dtype, in one of two orders.

* block-major (the default; the CPU kernels): ``kv[num_blocks, num_layers, 2, block_size,
  num_kv_heads, head_dim]`` (2: K, V). A block is ``kv[block_id]``: every layer's K and V of
  its tokens in one contiguous region, so a run of consecutive blocks is one region too, and
  moving blocks between workers (kvtransfer) or to host memory (swap) is one copy or one
  message per run rather than one per layer (vLLM's cross-layer KV layout for connectors
  makes the same choice). The native CPU kernels read a layer's K through the block tables
  with strides, which measured no slower than from a layer-major pool.
* layer-major (``layer_major=True``; FlexAttention, the CUDA path):
  ``kv[num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim]``. One layer's K
  (or V) of all blocks is then a single uniform-stride sequence of ``(num_blocks + 1) *
  block_size`` rows, which is what FlexAttention's paged form indexes through block
  tables; with the block-major order a layer's rows have two strides and cannot be one
  kernel operand. The extra block ``null_block`` (vLLM v1 keeps one too) is never
  allocated: padded rows of a fixed-shape step (CUDA graphs) write and read there.
  kvtransfer stages such a pool's blocks through slabs (``block_major`` is False).

Whatever the order, ``read_blocks`` returns and ``write_blocks`` takes blocks in the
block-major shape ``[n, num_layers, 2, block_size, H, D]``: that is the wire and swap format.

Every block is in exactly one of three states:
  * owned: ``ref_count > 0`` (held by one or more requests; shared prefix blocks by several);
  * cached-free: ``ref_count == 0`` with a hash: reusable by a prefix hit until evicted;
  * free: ``ref_count == 0`` without a hash.
Free and cached-free blocks share one LRU queue (an insertion-ordered dict, O(1) for every
operation): ``allocate`` takes from its front, evicting the cached content of what it takes
(``BlockRemoved``); ``free`` appends to its back; a prefix hit on a cached-free block takes it
out of the queue. Eviction is reuse-aware: cached blocks whose hashes are ``protect``ed (the
prefixes of requests waiting on this worker, as the policy names them) are passed over while
other blocks remain, keeping their place in the queue (the simulator's prefix cache does the
same, scheduler.prefix_index). Hashing a full block publishes it (``BlockStored``). The caller drains the
events (``drain_events``) and forwards them to whoever mirrors the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and placement of the pool tensor (the attributes kvtransfer's KVLayout has)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    num_blocks: int

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


@dataclass(slots=True)
class BlockStored:
    """Blocks whose content became a shareable prefix; ``parent_hash`` chains the first one."""

    block_hashes: list[int]
    parent_hash: int | None

    def to_dict(self) -> dict[str, object]:
        return {"type": "stored", "block_hashes": self.block_hashes, "parent_hash": self.parent_hash}


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks whose content was evicted (the hashes no longer resolve on this pool)."""

    block_hashes: list[int]

    def to_dict(self) -> dict[str, object]:
        return {"type": "removed", "block_hashes": self.block_hashes}


BlockEvent = BlockStored | BlockRemoved


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def available_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device`` now: CUDA's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


class BlockPool:
    """Preallocated KV blocks with reference counts, prefix hashes, LRU reuse and events."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        enable_caching: bool = True,
        layer_major: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        device = torch.device(device)
        self._layout = KVLayout(
            num_layers, num_kv_heads, head_dim, block_size, dtype, device, num_blocks
        )
        self.block_major = not layer_major
        # zeros (not empty): every page is touched now, so resident memory stays flat later.
        shape = ((num_blocks, num_layers, 2) if self.block_major
                 else (num_layers, 2, num_blocks + 1))
        self._kv = torch.zeros(
            (*shape, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._events: list[BlockEvent] = []
        self._protected: frozenset[int] = frozenset()
        self.num_protected_evictions = 0  # protected blocks evicted (nothing else was left)

    @staticmethod
    def blocks_for_budget(
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int | None = None,
        budget_bytes: int | None = None,
        fraction: float | None = None,
        available_bytes: int | None = None,
    ) -> int:
        """Number of blocks for a budget: a count, bytes, or a fraction of available memory.

        ``available_bytes`` defaults to the device's available memory now. A budget that
        holds no block, or that is larger than the available memory, is an
        EngineSettingError naming the setting (``num_kv_blocks``, ``kv_cache_bytes``,
        ``kv_cache_fraction``) and the limit.
        """
        from engine.errors import EngineSettingError

        probe = KVLayout(num_layers, num_kv_heads, head_dim, block_size, dtype, device, 1)
        per_block = probe.bytes_per_block
        if available_bytes is None:
            available_bytes = available_memory_bytes(device)
        where = f"{device.type} memory available"
        if num_blocks is not None:
            if num_blocks * per_block > available_bytes:
                raise EngineSettingError(
                    "num_kv_blocks", f"{num_blocks} blocks take {_gib(num_blocks * per_block)} "
                    f"({per_block} bytes each), more than the {_gib(available_bytes)} of {where}")
            return num_blocks
        setting = "kv_cache_bytes"
        if budget_bytes is None:
            if fraction is None:
                raise ValueError("give num_blocks, budget_bytes or fraction")
            setting = "kv_cache_fraction"
            budget_bytes = int(available_bytes * fraction)
        elif budget_bytes > available_bytes:
            raise EngineSettingError(
                setting, f"{_gib(budget_bytes)} asked, more than the {_gib(available_bytes)} of "
                f"{where}")
        count = budget_bytes // per_block
        if count < 1:
            raise EngineSettingError(
                setting, f"a budget of {budget_bytes} bytes holds no block ({per_block} bytes each)")
        return int(count)

    # ---- store interface (kvtransfer, swap) ----

    def kv_layout(self) -> KVLayout:
        return self._layout

    def kv_tensor(self) -> torch.Tensor:
        return self._kv

    @property
    def null_block(self) -> int | None:
        """The never-allocated block of a layer-major pool (padding rows); None otherwise."""
        return None if self.block_major else self._layout.num_blocks

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V of every block, each ``[blocks, block_size, H, D]`` (a view;
        a layer-major pool's include the null block)."""
        if self.block_major:
            return self._kv[:, layer, 0], self._kv[:, layer, 1]
        return self._kv[layer, 0], self._kv[layer, 1]

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A contiguous copy ``[n, num_layers, 2, block_size, H, D]`` of the blocks, in order."""
        index = self._index(block_ids)
        if self.block_major:
            return self._kv.index_select(0, index)
        return self._kv.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite the blocks with ``data`` (the shape ``read_blocks`` returns)."""
        layout = self._layout
        expected = (
            len(block_ids), layout.num_layers, 2, layout.block_size, layout.num_kv_heads,
            layout.head_dim,
        )
        if tuple(data.shape) != expected:
            raise ValueError(f"write_blocks: data shape {tuple(data.shape)}, expected {expected}")
        index = self._index(block_ids)
        data = data.to(device=self._kv.device, dtype=self._kv.dtype)
        if self.block_major:
            self._kv.index_copy_(0, index, data)
        else:
            self._kv.index_copy_(2, index, data.permute(1, 2, 0, 3, 4, 5))

    def copy_blocks(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copy every layer's K and V of each ``src_ids[i]`` into ``dst_ids[i]`` on the
        device (copy-on-write of a block that sequences share)."""
        if len(src_ids) != len(dst_ids):
            raise ValueError("copy_blocks: as many sources as destinations")
        src, dst = self._index(src_ids), self._index(dst_ids)
        if self.block_major:
            self._kv.index_copy_(0, dst, self._kv.index_select(0, src))
        else:
            self._kv.index_copy_(2, dst, self._kv.index_select(2, src))

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        n = self._layout.num_blocks
        for b in block_ids:
            if not 0 <= b < n:
                raise ValueError(f"block id {b} out of range [0, {n})")
        return torch.tensor(list(block_ids), dtype=torch.long, device=self._kv.device)

    # ---- accounting ----

    @property
    def num_blocks(self) -> int:
        return self._layout.num_blocks

    @property
    def block_size(self) -> int:
        return self._layout.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free plus cached-free)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a published prefix (owned or cached-free)."""
        return len(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._block_hashes[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` fresh blocks (ref count 1), or None when there are not that many."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free):
            return None
        block_ids: list[int] = []
        evicted: list[int] = []
        protected = self._protected
        passed: list[int] = []  # protected blocks passed over, in queue order
        while len(block_ids) < num_blocks:
            if self._free:
                block_id, _ = self._free.popitem(last=False)
                block_hash = self._block_hashes[block_id]
                if protected and block_hash is not None and block_hash in protected:
                    passed.append(block_id)
                    continue
            else:  # only protected blocks are left: the oldest of them go
                block_id = passed.pop(0)
                block_hash = self._block_hashes[block_id]
                self.num_protected_evictions += 1
            if block_hash is not None:
                self._block_hashes[block_id] = None
                del self._hash_to_block[block_hash]
                evicted.append(block_hash)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        for block_id in reversed(passed):  # back to the front, in their order
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        if evicted:
            self._events.append(BlockRemoved(evicted))
        return block_ids

    def protect(self, block_hashes: Collection[int]) -> None:
        """Evict cached blocks with these hashes only when no other block is left (replaces
        the previous set; empty: plain LRU)."""
        self._protected = frozenset(block_hashes)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced ones join the LRU queue's back.

        ``block_ids`` is a block table (prefix first); its tail is queued first, so a request's
        last blocks are evicted before its shared prefix.
        """
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"block {block_id} freed more often than allocated")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                if self._block_hashes[block_id] is None:
                    # No content worth keeping: reuse before any cached block.
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._free[block_id] = None

    def lookup_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of ``block_hashes``; takes no reference."""
        if not self.enable_caching:
            return []
        block_ids: list[int] = []
        for block_hash in block_hashes:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take one more reference to each block (cached-free ones leave the LRU queue)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def cache_blocks(
        self, block_ids: Sequence[int], block_hashes: Sequence[int], parent_hash: int | None
    ) -> None:
        """Publish full owned blocks under their chained hashes (one ``BlockStored`` per run).

        A hash already held by another block keeps that block; this one stays private.
        """
        if not self.enable_caching:
            return
        run: list[int] = []
        run_parent = parent_hash
        previous = parent_hash
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            if self._block_hashes[block_id] is None and block_hash not in self._hash_to_block:
                self._block_hashes[block_id] = block_hash
                self._hash_to_block[block_hash] = block_id
                if not run:
                    run_parent = previous
                run.append(block_hash)
            elif run:
                self._events.append(BlockStored(run, run_parent))
                run = []
            previous = block_hash
        if run:
            self._events.append(BlockStored(run, run_parent))

    def drain_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (tests and idle checks)."""
        for block_id in range(self.num_blocks):
            count = self._ref_counts[block_id]
            if count < 0:
                raise AssertionError(f"block {block_id} has ref count {count}")
            if (count == 0) != (block_id in self._free):
                raise AssertionError(f"block {block_id}: ref count {count} vs free queue")
            block_hash = self._block_hashes[block_id]
            if block_hash is not None and self._hash_to_block.get(block_hash) != block_id:
                raise AssertionError(f"block {block_id}: hash map out of step")
        if len(self._hash_to_block) != sum(h is not None for h in self._block_hashes):
            raise AssertionError("hash map holds blocks that have no hash")

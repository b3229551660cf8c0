"""Prefix index: which KV blocks a worker holds, by chained block hash (DESIGN §3).

:class:`PrefixIndex` is one worker's prefix cache: entries keyed by a block's
chained hash, each with a reference count (live requests using it) and an LRU
order over unreferenced entries. ``acquire`` pins a prompt's cached prefix and
inserts the rest, evicting as needed; ``release`` unpins. Eviction is
reuse-aware: entries named in ``protected`` (blocks that prefix waiting
higher-tier requests) go last. Leaves are touched before their parents, so the
LRU end holds leaves and eviction does not orphan a live chain.

:class:`PrefixMirror` is the global scheduler's view of every worker's cache,
fed by the workers' ``BlockStored``/``BlockRemoved`` events; placement asks it
how long a prefix each worker holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class _Entry:
    parent: int | None
    refs: int = 0


class PrefixIndex:
    """Capacity is in entries (blocks); pinned entries are never evicted."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity: must be positive, got {capacity}")
        self.capacity = capacity
        self._entries: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unpinned, least recent first
        self.num_lookup_blocks = 0
        self.num_hit_blocks = 0

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_blocks / self.num_lookup_blocks if self.num_lookup_blocks else 0.0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def match_len(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` held here. Does not change the cache."""
        n = 0
        entries = self._entries
        for h in hashes:
            if h not in entries:
                break
            n += 1
        return n

    def acquire(self, hashes: Sequence[int],
                protected: Collection[int] | Callable[[], Collection[int]] = ()) -> int | None:
        """Pin the cached prefix of ``hashes`` and insert the rest; return the hit count.

        Returns None (and changes nothing) when the uncached part does not fit even
        after evicting every unpinned entry. Counts toward the hit rate.
        ``protected`` may be a function, called only when something must be evicted.
        """
        hits = self.match_len(hashes)
        need = len(hashes) - hits
        free = self.capacity - len(self._entries)
        # Hit entries that are unpinned now become pinned, so they cannot be evicted.
        hit_unpinned = sum(1 for h in hashes[:hits] if self._entries[h].refs == 0)
        if need > free + len(self._lru) - hit_unpinned:
            return None
        self.num_lookup_blocks += len(hashes)
        self.num_hit_blocks += hits
        for h in hashes[:hits]:
            e = self._entries[h]
            if e.refs == 0:
                del self._lru[h]
            e.refs += 1
        if need > free:
            self.evict(need - free, protected() if callable(protected) else protected)
        parent = hashes[hits - 1] if hits else None
        for h in hashes[hits:]:
            e = self._entries.get(h)
            if e is None:
                self._entries[h] = _Entry(parent=parent, refs=1)
            else:
                # Cached beyond the match (its ancestor was evicted): pin it in
                # place; left in the LRU, a pinned block could be evicted.
                if e.refs == 0:
                    del self._lru[h]
                e.refs += 1
                e.parent = parent
            parent = h
        return hits

    def release(self, hashes: Sequence[int]) -> None:
        """Unpin; unreferenced entries become most recently used, leaves first."""
        for h in reversed(hashes):
            e = self._entries.get(h)
            if e is None or e.refs == 0:
                continue
            e.refs -= 1
            if e.refs == 0:
                self._lru[h] = None
        # Parents were appended after their children: leaves sit nearer the LRU end.

    def evict(self, num_blocks: int, protected: Collection[int] = ()) -> list[int]:
        """Evict up to ``num_blocks`` unpinned entries, ``protected`` ones last."""
        out: list[int] = []
        if num_blocks <= 0:
            return out
        skipped: list[int] = []
        for h in list(self._lru):
            if len(out) >= num_blocks:
                break
            if h in protected:
                skipped.append(h)
                continue
            out.append(h)
        for h in skipped:
            if len(out) >= num_blocks:
                break
            out.append(h)
        for h in out:
            del self._lru[h]
            del self._entries[h]
        return out

    def insert_cached(self, hashes: Iterable[int], parent: int | None = None) -> int:
        """Add unpinned entries (a mirrored ``BlockStored``); returns how many were new."""
        n = 0
        for h in hashes:
            if h not in self._entries:
                if len(self._entries) >= self.capacity and not self.evict(1):
                    break
                self._entries[h] = _Entry(parent=parent)
                self._lru[h] = None
                n += 1
            parent = h
        return n

    def remove(self, hashes: Iterable[int]) -> None:
        """Drop entries (a mirrored ``BlockRemoved``); pinned ones are kept."""
        for h in hashes:
            e = self._entries.get(h)
            if e is not None and e.refs == 0:
                del self._entries[h]
                self._lru.pop(h, None)


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_hash: int | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]


class PrefixMirror:
    """The global view: which workers hold which block hashes (from block events).

    A block's holders are a frozenset shared by every block the same workers hold (one
    object per distinct set of workers): a prompt's shared prefix is mostly held by the
    same workers, and ``match_lens`` walks it comparing identities instead of sets."""

    def __init__(self) -> None:
        self._holders: dict[int, frozenset[str]] = {}
        # Each distinct holder set, and the set one more (or one fewer) worker makes of it.
        self._sets: dict[frozenset[str], frozenset[str]] = {}
        self._plus: dict[tuple[frozenset[str], str], frozenset[str]] = {}
        self._minus: dict[tuple[frozenset[str], str], frozenset[str]] = {}

    def _shared(self, s: frozenset[str]) -> frozenset[str]:
        if len(self._sets) > 4 * len(self._holders) + 64:
            # Sets no block has any more (workers come and go): start the tables afresh.
            self._sets = {x: x for x in self._holders.values()}
            self._plus, self._minus = {}, {}
        return self._sets.setdefault(s, s)

    def apply(self, worker_id: str, event: BlockStored | BlockRemoved) -> None:
        holders = self._holders
        if isinstance(event, BlockStored):
            plus = self._plus
            empty: frozenset[str] = frozenset()
            for h in event.block_hashes:
                old = holders.get(h, empty)
                if worker_id in old:
                    continue
                new = plus.get((old, worker_id))
                if new is None:
                    new = self._shared(old | {worker_id})
                    self._plus[(old, worker_id)] = new
                holders[h] = new
        else:
            minus = self._minus
            for h in event.block_hashes:
                old = holders.get(h)
                if old is None or worker_id not in old:
                    continue
                if len(old) == 1:
                    del holders[h]
                    continue
                new = minus.get((old, worker_id))
                if new is None:
                    new = self._shared(old - {worker_id})
                    self._minus[(old, worker_id)] = new
                holders[h] = new

    def drop_worker(self, worker_id: str) -> None:
        """A worker died or restarted: forget everything it held."""
        for h in [h for h, s in self._holders.items() if worker_id in s]:
            self.apply(worker_id, BlockRemoved([h]))

    def match_lens(self, hashes: Sequence[int], worker_ids: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each worker holds. One walk down the prompt with
        the workers still matching (a walk per worker cost workers x prefix: the most of a
        placement, for long prompts that several workers hold)."""
        out = dict.fromkeys(worker_ids, 0)
        alive = set(out)
        holders = self._holders
        ok: frozenset[str] | None = None  # a holder set known to contain all of alive
        n = 0
        for s in map(holders.get, hashes):
            if s is None:
                break
            if s is not ok:
                if not alive <= s:
                    still = alive & s
                    for w in alive - still:
                        out[w] = n
                    alive = still
                    if not alive:
                        return out
                ok = s
            n += 1
        for w in alive:
            out[w] = n
        return out

"""Prefix index, its global mirror and the per-worker block account."""

from __future__ import annotations

import random

import pytest

from scheduler.kv import KVBlockAccount
from scheduler.prefix_index import BlockRemoved, BlockStored, PrefixIndex, PrefixMirror


def test_acquire_counts_hits_and_pins() -> None:
    idx = PrefixIndex(capacity=6)
    assert idx.acquire([1, 2, 3]) == 0
    idx.release([1, 2, 3])
    assert idx.acquire([1, 2, 4]) == 2
    assert idx.hit_rate == pytest.approx(2 / 6)
    # 1, 2, 4 pinned; 3 evictable; capacity 6 -> 3 new blocks need one eviction.
    assert idx.acquire([7, 8, 9]) == 0
    assert 3 not in idx and 1 in idx
    # Everything pinned now: nothing more fits, and nothing changes.
    assert idx.acquire([11]) is None and idx.num_cached == 6


def test_eviction_takes_leaves_first_and_spares_protected_blocks() -> None:
    idx = PrefixIndex(capacity=4)
    idx.acquire([1, 2])
    idx.release([1, 2])
    idx.acquire([3, 4])
    idx.release([3, 4])
    assert idx.evict(1) == [2]  # leaf of the least recent chain
    assert idx.evict(1, protected={4, 3}) == [1]
    assert idx.evict(5) == [4, 3]


def test_match_len_needs_a_contiguous_prefix() -> None:
    idx = PrefixIndex(capacity=8)
    idx.insert_cached([1, 2, 3])
    assert idx.match_len([1, 2, 9, 3]) == 2
    assert idx.match_len([2, 3]) == 2
    idx.remove([2])
    assert idx.match_len([1, 2, 3]) == 1


def test_mirror_tracks_workers_from_block_events() -> None:
    m = PrefixMirror()
    m.apply("a", BlockStored([1, 2, 3], None))
    m.apply("b", BlockStored([1], None))
    assert m.match_lens([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    m.apply("a", BlockRemoved([2]))
    assert m.match_lens([1, 2, 3], ["a"]) == {"a": 1}
    m.drop_worker("b")
    assert m.match_lens([1], ["b"]) == {"b": 0}


def test_mirror_match_lens_equals_a_walk_per_worker() -> None:
    """The one walk with the workers still matching (and its single-worker tail) gives
    each worker the length of the prefix it holds, as walking the prompt per worker does."""
    rng = random.Random(5)
    workers = ["a", "b", "c", "d"]
    for _ in range(300):
        m = PrefixMirror()
        held = {w: {h for h in range(12) if rng.random() < 0.7} for w in workers}
        for w, hs in held.items():
            m.apply(w, BlockStored(sorted(hs), None))
        prompt = [rng.randrange(12) for _ in range(rng.randint(0, 10))]
        asked = rng.sample(workers, rng.randint(1, 4))
        want = {}
        for w in asked:
            n = 0
            while n < len(prompt) and prompt[n] in held[w]:
                n += 1
            want[w] = n
        assert m.match_lens(prompt, asked) == want


def test_block_account_is_all_or_nothing_and_evicts_cached() -> None:
    acc = KVBlockAccount("w", 10)
    assert acc.allocate("a", 6)
    assert not acc.allocate("b", 5) and acc.num_owned == 6 and "b" not in acc.owned
    assert acc.release("a", keep_cached=4) == 6
    assert acc.num_cached == 4 and acc.num_free == 6
    assert acc.allocate("b", 8)  # two cached blocks evicted
    assert acc.num_cached == 2 and acc.num_free == 0
    with pytest.raises(ValueError):
        acc.allocate("c", -1)

"""Block pool: all-or-nothing allocation, ref counts, prefix hashes, LRU reuse, events, I/O."""

from __future__ import annotations

import pytest
import torch

from engine import (
    BlockPool,
    BlockRemoved,
    BlockStored,
    EngineSettingError,
    compute_block_hashes,
    hash_block_tokens,
)


def make_pool(num_blocks: int = 8, **kw) -> BlockPool:
    return BlockPool(
        num_layers=2, num_kv_heads=2, head_dim=4, num_blocks=num_blocks, block_size=4, **kw
    )


def test_allocate_is_all_or_nothing() -> None:
    pool = make_pool(4)
    first = pool.allocate(3)
    assert first is not None and len(set(first)) == 3
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) is not None
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_free_and_ref_counts() -> None:
    pool = make_pool(4)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.acquire(blocks[:1])
    assert pool.ref_count(blocks[0]) == 2
    pool.free(blocks)
    assert pool.ref_count(blocks[0]) == 1 and pool.ref_count(blocks[1]) == 0
    assert pool.num_free_blocks == 3
    pool.free(blocks[:1])
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="freed more often"):
        pool.free(blocks[:1])
    pool.check_integrity()


def test_hashes_are_chained_and_deterministic() -> None:
    tokens = list(range(10))
    hashes = compute_block_hashes(tokens, 4)
    assert len(hashes) == 2  # the trailing partial block has no hash
    assert hashes[0] == hash_block_tokens(None, tokens[:4])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])
    # Same tokens under another parent: another identity.
    assert hash_block_tokens(hashes[0], tokens[:4]) != hashes[0]
    assert compute_block_hashes([9, 9, 9, 9] + tokens[4:8], 4)[1] != hashes[1]


def test_prefix_cache_reuse_eviction_and_events() -> None:
    pool = make_pool(4)
    tokens = list(range(8))
    hashes = compute_block_hashes(tokens, 4)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.cache_blocks(blocks, hashes, None)
    assert pool.drain_events() == [BlockStored(hashes, None)]
    assert pool.drain_events() == []
    pool.free(blocks)
    # Cached-free blocks still resolve, and a hit takes them out of the free queue.
    assert pool.lookup_prefix(hashes) == blocks
    assert pool.lookup_prefix([hashes[1]]) == [blocks[1]]
    assert pool.lookup_prefix([123, hashes[0]]) == []
    pool.acquire(blocks[:1])
    assert pool.num_free_blocks == 3
    # Allocating everything else evicts the other cached block (and reports it).
    rest = pool.allocate(3)
    assert rest is not None and blocks[1] in rest
    assert pool.drain_events() == [BlockRemoved([hashes[1]])]
    assert pool.lookup_prefix(hashes) == blocks[:1]
    pool.check_integrity()


def test_lru_evicts_least_recently_freed_and_plain_blocks_first() -> None:
    pool = make_pool(3)
    a = pool.allocate(1)
    b = pool.allocate(1)
    c = pool.allocate(1)
    assert a and b and c
    pool.cache_blocks(a, [11], None)
    pool.cache_blocks(b, [22], None)
    pool.free(a)
    pool.free(b)
    pool.free(c)  # no hash: reused before either cached block
    assert pool.allocate(1) == c
    assert pool.allocate(1) == a  # a was freed before b
    assert pool.lookup_prefix([22]) == b
    assert pool.lookup_prefix([11]) == []


def test_duplicate_hash_keeps_first_block() -> None:
    pool = make_pool(4)
    x = pool.allocate(1)
    y = pool.allocate(1)
    assert x and y
    pool.cache_blocks(x, [5], None)
    pool.cache_blocks(y, [5], None)
    assert pool.lookup_prefix([5]) == x
    assert pool.block_hash(y[0]) is None
    assert len(pool.drain_events()) == 1


def test_caching_disabled() -> None:
    pool = make_pool(2, enable_caching=False)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.cache_blocks(blocks, [7], None)
    assert pool.lookup_prefix([7]) == [] and pool.drain_events() == []


def test_read_write_round_trip_and_layout() -> None:
    pool = make_pool(6, dtype=torch.bfloat16)
    layout = pool.kv_layout()
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size) == (
        2, 2, 4, 4,
    )
    assert layout.dtype == torch.bfloat16 and layout.device.type == "cpu"
    assert pool.kv_tensor().shape == (6, 2, 2, 4, 2, 4)  # block-major: a block is kv[id]
    assert pool.kv_tensor()[1].is_contiguous()
    data = torch.randn(3, 2, 2, 4, 2, 4).to(torch.bfloat16)
    pool.write_blocks([4, 1, 2], data)
    assert torch.equal(pool.read_blocks([4, 1, 2]), data)
    assert torch.equal(pool.kv_tensor()[1], data[1])
    assert torch.equal(pool.read_blocks([2]), data[2:3])
    with pytest.raises(ValueError, match="shape"):
        pool.write_blocks([0], data)
    with pytest.raises(ValueError, match="out of range"):
        pool.read_blocks([6])


def test_budget_sizing() -> None:
    shape = dict(
        num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32,
        device=torch.device("cpu"),
    )
    per_block = 2 * 2 * 4 * 2 * 4 * 4
    assert BlockPool.blocks_for_budget(**shape, num_blocks=7) == 7
    assert BlockPool.blocks_for_budget(**shape, budget_bytes=per_block * 10 + 1) == 10
    assert BlockPool.blocks_for_budget(**shape, fraction=1e-6) >= 1
    with pytest.raises(ValueError, match="holds no block"):
        BlockPool.blocks_for_budget(**shape, budget_bytes=per_block - 1)


def test_budgets_that_do_not_fit_name_the_setting_and_the_limit() -> None:
    shape = dict(
        num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32,
        device=torch.device("cpu"), available_bytes=10 * 2**20,
    )
    per_block = 2 * 2 * 4 * 2 * 4 * 4
    assert BlockPool.blocks_for_budget(**shape, fraction=0.5) == 5 * 2**20 // per_block
    with pytest.raises(EngineSettingError, match=r"kv_cache_bytes: 1.00 GiB asked.*0.01 GiB"):
        BlockPool.blocks_for_budget(**shape, budget_bytes=2**30)
    with pytest.raises(EngineSettingError, match=r"num_kv_blocks: 1000000 blocks take"):
        BlockPool.blocks_for_budget(**shape, num_blocks=1_000_000)
    with pytest.raises(EngineSettingError, match="kv_cache_fraction: .*holds no block"):
        BlockPool.blocks_for_budget(**shape, fraction=1e-9)

"""KV memory in one engine: the bounded swap space, migration between two engines,
reuse-aware eviction and the prefix hit counters."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import BlockPool, EngineConfig, LLMEngine, SamplingParams, compute_block_hashes
from engine.requests import ReqState
from engine.swap_space import SwapSpace

GREEDY = SamplingParams(max_tokens=24)
PROMPTS = [[(7 * i + 3 * k) % 250 for k in range(40 + 9 * i)] for i in range(4)]


def make_engine(path: Path, **overrides) -> LLMEngine:
    settings = dict(model=str(path), dtype="float32", num_kv_blocks=64, prefill_chunk_size=32)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def decode_until(engine: LLMEngine, outputs: dict[str, list[int]], n: int) -> None:
    while any(len(o) < n for o in outputs.values()):
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)


def finish(engine: LLMEngine, outputs: dict[str, list[int]]) -> None:
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)


@pytest.fixture(scope="module")
def reference(tiny_checkpoints) -> list[list[int]]:
    return make_engine(tiny_checkpoints["llama"]).generate(PROMPTS, GREEDY)


def test_swap_space_counts_blocks_and_refuses_what_does_not_fit() -> None:
    space = SwapSpace(num_blocks=10, num_bytes=8 * 100, bytes_per_block=100)
    assert space.capacity == 8  # the smaller of the two budgets
    space.take(5)
    assert not space.can_hold(4) and space.num_free == 3
    with pytest.raises(ValueError, match="full"):
        space.take(4)
    space.give(5)
    assert space.num_used == 0 and space.num_peak == 5
    assert SwapSpace().can_hold(10**9) and SwapSpace().num_free is None


def test_swap_out_over_budget_is_refused_before_copying(tiny_checkpoints, reference) -> None:
    engine = make_engine(tiny_checkpoints["llama"], num_swap_blocks=4)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    decode_until(engine, outputs, 3)
    # r0 (40 prompt tokens + outputs) fits in 4 blocks of 16; r3 (67 + outputs) does not.
    assert engine.can_swap_out("r0") and not engine.can_swap_out("r3")
    free = engine.num_free_blocks
    assert not engine.swap_out("r3")
    assert engine.request_state("r3") is ReqState.RUNNING and engine.num_free_blocks == free
    assert engine.swap_out("r0") and engine.swap.num_used == engine.swap.num_peak == 3
    assert not engine.can_swap_out("r1")  # 49 + 3 tokens: 4 blocks, 1 left in the space
    assert engine.preempt_recompute("r1")
    assert engine.swap_in("r0") and engine.swap.num_used == 0
    assert engine.swap_out("r2") and engine.swap.num_used == 4
    engine.abort("r2")  # dropping a swapped request gives its space back
    assert engine.swap.num_used == 0 and engine.swap.num_peak == 4
    finish(engine, outputs)
    assert [outputs[f"r{i}"] for i in (0, 1, 3)] == [reference[i] for i in (0, 1, 3)]
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.pool.check_integrity()


def test_a_request_migrated_mid_decode_continues_token_for_token(tiny_checkpoints,
                                                                   reference) -> None:
    """Engine to engine (the blocks copied as kvtransfer would: the wire layout of
    read_blocks), with the target's prefix cache already holding part of the prompt."""
    src = make_engine(tiny_checkpoints["llama"])
    dst = make_engine(tiny_checkpoints["llama"], num_kv_blocks=48)
    dst.generate([PROMPTS[1][:32]], SamplingParams(max_tokens=1))  # 2 blocks cached there
    for i, p in enumerate(PROMPTS):
        src.add_request(f"r{i}", p, GREEDY)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    decode_until(src, outputs, 7)
    snap = src.detach_for_migration("r1")
    assert snap is not None and src.request_state("r1") is ReqState.MIGRATING
    assert list(snap.output_token_ids) == outputs["r1"]
    assert snap.num_computed == len(snap.token_ids) - 1
    for _ in range(3):  # the others decode on; the detached one does not
        for out in src.step():
            outputs[out.req_id].extend(out.new_token_ids)
    assert len(outputs["r1"]) == len(snap.output_token_ids)
    blocks = dst.reserve("r1", snap.num_computed, prompt_token_ids=snap.token_ids)
    assert blocks is not None and dst.num_reserved_cached_blocks("r1") == 2
    dst.pool.write_blocks(blocks[2:], src.pool.read_blocks(snap.block_ids[2:]))
    src.abort("r1")  # moved: the source frees its blocks
    dst.add_migrated_request("r1", snap.token_ids, snap.num_prompt_tokens, GREEDY, blocks)
    moved = {"r1": outputs.pop("r1")}
    finish(dst, moved)
    finish(src, outputs)
    assert moved["r1"] == reference[1]
    assert [outputs[f"r{i}"] for i in (0, 2, 3)] == [reference[i] for i in (0, 2, 3)]
    for e in (src, dst):
        assert e.num_free_blocks == e.num_total_blocks
        e.pool.check_integrity()


def test_a_refused_or_failed_move_leaves_the_request_whole(tiny_checkpoints, reference) -> None:
    engine = make_engine(tiny_checkpoints["llama"])
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(f"r{i}", p, GREEDY)
    outputs: dict[str, list[int]] = {"r0": [], "r1": []}
    decode_until(engine, outputs, 4)
    assert engine.detach_for_migration("r0") is not None
    assert engine.detach_for_migration("r0") is None  # not running any more
    assert engine.reattach("r0")  # the target refused: it decodes here again
    assert engine.detach_for_migration("r1") is not None
    assert engine.preempt_recompute("r1")  # the transfer failed: recomputed here
    finish(engine, outputs)
    assert [outputs["r0"], outputs["r1"]] == reference[:2]
    assert engine.num_free_blocks == engine.num_total_blocks


def test_protected_cached_blocks_are_evicted_last() -> None:
    pool = BlockPool(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=6, block_size=4)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]
    ha, hb = compute_block_hashes(a, 4), compute_block_hashes(b, 4)
    for hashes in (ha, hb):
        blocks = pool.allocate(2)
        pool.cache_blocks(blocks, hashes, None)
        pool.free(blocks)
    # LRU order: a's blocks are older; protecting them sends b's out first.
    pool.protect(ha)
    got = pool.allocate(4)
    assert got is not None and len(pool.lookup_prefix(ha)) == 2 and not pool.lookup_prefix(hb)
    assert pool.num_protected_evictions == 0
    pool.free(got)
    assert pool.allocate(6) is not None  # nothing else left: protected blocks go too
    assert pool.num_protected_evictions == 2 and not pool.lookup_prefix(ha)
    pool.check_integrity()


def test_plain_lru_without_protection() -> None:
    pool = BlockPool(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=4, block_size=4)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    for tokens in (a, b):
        blocks = pool.allocate(1)
        pool.cache_blocks(blocks, compute_block_hashes(tokens, 4), None)
        pool.free(blocks)
    assert pool.allocate(3) is not None
    assert not pool.lookup_prefix(compute_block_hashes(a, 4))
    assert pool.lookup_prefix(compute_block_hashes(b, 4))


def test_prefix_hit_counters(tiny_checkpoints) -> None:
    engine = make_engine(tiny_checkpoints["llama"])
    engine.generate([PROMPTS[2]], SamplingParams(max_tokens=1))  # 58 tokens: 3 full blocks
    assert (engine.num_prefix_query_blocks, engine.num_prefix_hit_blocks) == (3, 0)
    engine.generate([PROMPTS[2] + [5] * 10], SamplingParams(max_tokens=1))  # 4 blocks
    assert (engine.num_prefix_query_blocks, engine.num_prefix_hit_blocks) == (7, 3)
    assert engine.reserve("x", 40, prompt_token_ids=PROMPTS[2]) is not None
    assert (engine.num_prefix_query_blocks, engine.num_prefix_hit_blocks) == (9, 5)

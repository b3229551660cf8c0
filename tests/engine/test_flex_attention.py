"""FlexAttention over a layer-major pool through block tables (engine.flex_attention), on
CPU in FlexAttention's eager reference mode, against attention over gathered keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.block_pool import BlockPool
from engine.flex_attention import FlexPagedAttention, FlexStepMeta, build_batch, flex_available

pytestmark = pytest.mark.skipif(not flex_available(), reason="torch has no FlexAttention")

L, HQ, HKV, D, BS, NB = 2, 6, 2, 16, 4, 40


def make_pool(seed: int = 0) -> BlockPool:
    pool = BlockPool(num_layers=L, num_kv_heads=HKV, head_dim=D, num_blocks=NB, block_size=BS,
                     layer_major=True)
    gen = torch.Generator().manual_seed(seed)
    pool.kv_tensor().copy_(torch.randn(pool.kv_tensor().shape, generator=gen))
    return pool


def reference(pool: BlockPool, layer: int, q: torch.Tensor, table: list[int], pos: int,
              window: int | None) -> torch.Tensor:
    """q [Hq, D] at ``pos`` over keys 0..pos of the sequence whose blocks are ``table``."""
    k_all, v_all = pool.layer_kv(layer)
    idx = torch.tensor(table)
    k = k_all.index_select(0, idx).reshape(-1, HKV, D)[: pos + 1]
    v = v_all.index_select(0, idx).reshape(-1, HKV, D)[: pos + 1]
    if window is not None:
        k, v = k[max(0, pos + 1 - window):], v[max(0, pos + 1 - window):]
    o = F.scaled_dot_product_attention(q.view(1, HQ, 1, D), k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], enable_gqa=True, scale=0.3)
    return o.view(HQ, D)


@pytest.mark.parametrize("window", [None, 5])
def test_decodes_and_chunks_match_gathered_attention(window: int | None) -> None:
    pool = make_pool()
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randperm(NB, generator=gen).tolist()
    # two decodes (context 7 and 13 tokens) and two chunks (3 new tokens after a 6-token
    # prefix; 9 tokens from position 0), their tables from scattered blocks
    tables = [blocks[0:2], blocks[2:6], blocks[6:9], blocks[9:12]]
    decode_pos = [6, 12]
    chunk_spans = [(6, 3), (0, 9)]
    num_rows = 2 + 3 + 9
    layer = 1
    query = torch.randn(num_rows, HQ, D, generator=gen)
    key = torch.randn(num_rows, HKV, D, generator=gen)
    value = torch.randn(num_rows, HKV, D, generator=gen)
    slot = []
    positions = decode_pos + [p for first, n in chunk_spans for p in range(first, first + n)]
    seq_of_row = [0, 1] + [2] * 3 + [3] * 9
    for row, p in enumerate(positions):
        slot.append(tables[seq_of_row[row]][p // BS] * BS + p % BS)
    batches = [
        build_batch(tables[:2], [[0], [1]], [[6], [12]], NB + 1, pool.null_block, pool.kv_tensor().device),
        build_batch(tables[2:], [list(range(2, 5)), list(range(5, 14))],
                    [list(range(6, 9)), list(range(0, 9))], NB + 1, pool.null_block,
                    pool.kv_tensor().device),
    ]
    meta = FlexStepMeta(kv=pool.kv_tensor(), slot_rows=torch.tensor(slot), batches=batches)
    out = FlexPagedAttention(compiled=False).forward(layer, query, key, value, meta, window, 0.3)
    out = out.view(num_rows, HQ, D)
    # the step's K and V landed in their slots of this layer only
    k_all, v_all = pool.layer_kv(layer)
    for row, s in enumerate(slot):
        assert torch.equal(k_all.reshape(-1, HKV, D)[s], key[row])
        assert torch.equal(v_all.reshape(-1, HKV, D)[s], value[row])
    for row, p in enumerate(positions):
        ref = reference(pool, layer, query[row], tables[seq_of_row[row]], p, window)
        torch.testing.assert_close(out[row], ref, atol=1e-5, rtol=1e-5)


def test_layer_major_pool_reads_and_writes_block_major_shape() -> None:
    pool = make_pool()
    data = pool.read_blocks([3, 1])
    assert data.shape == (2, L, 2, BS, HKV, D) and data.is_contiguous()
    k1, v1 = pool.layer_kv(1)
    assert torch.equal(data[0, 1, 0], k1[3]) and torch.equal(data[1, 1, 1], v1[1])
    pool.write_blocks([5, 6], data)
    assert torch.equal(pool.read_blocks([5, 6]), data)
    assert pool.null_block == NB and not pool.block_major
    assert pool.allocate(NB) is not None and pool.allocate(1) is None  # null never handed out

"""Slabs, their cached views, the pool copies (numpy on host pools, torch otherwise) and the
inline push path's deferred reaping of sends."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvtransfer import (
    KVConsumer,
    KVLayout,
    KVProducer,
    Location,
    MockBackend,
    MockHub,
    TensorKVStore,
    TransferConfig,
    TransferState,
    wire,
)
from kvtransfer.buffers import PoolView, Slab, SlabPool
from kvtransfer.testing import wait_terminal
from kvtransfer.transfers import run_slices

torch.set_num_threads(1)


def layout_of(dtype: torch.dtype = torch.float32) -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, dtype=dtype,
                    device=torch.device("cpu"))


def random_store(layout: KVLayout, num_blocks: int, seed: int) -> TensorKVStore:
    store = TensorKVStore(layout, num_blocks)
    gen = torch.Generator().manual_seed(seed)
    store.kv_tensor().copy_(torch.randn(store.kv_tensor().shape, generator=gen).to(layout.dtype))
    return store


class StridedStore:
    """A pool whose last dim is not contiguous: no byte view, copies go through torch."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads,
                 2 * layout.head_dim)
        self._kv = torch.randn(shape).to(layout.dtype)[..., ::2]
        self._layout = layout

    def kv_layout(self) -> KVLayout:
        return self._layout

    def kv_tensor(self) -> torch.Tensor:
        return self._kv


def test_slab_views_share_its_memory_and_are_made_once():
    layout = layout_of()
    slab = SlabPool(layout, wire.FRAME_HEADER_BYTES, 4 * layout.bytes_per_block).take(0)
    group = slab.group(2)
    assert isinstance(group, np.ndarray) and slab.group(2) is group
    assert group.shape == (3, 2, 2, 2, 2, 4 * 4)  # the last dim in bytes
    group[...] = 7
    payload = slab.tensor[wire.FRAME_HEADER_BYTES:wire.FRAME_HEADER_BYTES + 2 * layout.bytes_per_block]
    assert bool((payload == 7).all())
    assert slab.tensor_group(2).shape == layout.group_shape(2)
    assert slab.tensor_group(2).data_ptr() == payload.data_ptr()
    message = slab.message(layout.bytes_per_block)
    assert slab.message(layout.bytes_per_block) is message
    assert message.numel() == wire.FRAME_HEADER_BYTES + layout.bytes_per_block
    assert message.data_ptr() == slab.tensor.data_ptr()
    staging = SlabPool(layout, 0, 4 * layout.bytes_per_block).take(0)
    typed = staging.message(layout.bytes_per_block, layout.dtype)
    assert typed.dtype == layout.dtype and typed.numel() * 4 == layout.bytes_per_block


def test_frame_header_through_the_byte_view_and_the_tensor_agree():
    slab = Slab(torch.zeros(wire.FRAME_HEADER_BYTES + 64, dtype=torch.uint8),
                wire.FRAME_HEADER_BYTES, layout_of())
    assert isinstance(slab.header, memoryview) and len(slab.header) == wire.FRAME_HEADER_BYTES
    msg = wire.Blocks(req="r", positions=[0, 1], dst=[5, 6], layers=[0, 3], dtype="float32",
                      block_shape=[2, 2, 4], parts=[2], nbytes=2 * 384, crc=None, direct=[0])
    wire.write_frame_header(msg, slab.header)
    assert wire.read_frame_header(slab.tensor) == msg  # what a tensor reader sees
    end = wire.End("r", TransferState.ABORTED)
    wire.write_frame_header(end, slab.tensor)
    assert wire.read_frame_header(slab.header) == end


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_pool_copies_match_the_store_on_host_pools(dtype):
    layout = layout_of(dtype)
    src = random_store(layout, 16, seed=1)
    dst = TensorKVStore(layout, 16)
    ids = [3, 4, 5, 9, 1, 2, 15]  # runs and single blocks
    slab = SlabPool(layout, 0, len(ids) * layout.bytes_per_block).take(0)
    PoolView(src, layout).gather(ids, slab)
    assert torch.equal(slab.tensor_group(len(ids)).view(torch.uint8),
                       src.read_blocks(ids).view(torch.uint8))
    slots = [10, 11, 0, 6, 7, 8, 12]
    PoolView(dst, layout).scatter(slots, slab)
    assert torch.equal(dst.read_blocks(slots).view(torch.uint8),
                       src.read_blocks(ids).view(torch.uint8))
    assert not dst.read_blocks([1, 2, 3, 4, 5]).view(torch.uint8).any()  # nothing else written


def test_pool_copies_fall_back_to_torch_for_a_pool_without_a_byte_view():
    layout = layout_of()
    src, dst = StridedStore(layout, 8), StridedStore(layout, 8)
    slab = SlabPool(layout, 0, 2 * layout.bytes_per_block).take(0)
    PoolView(src, layout).gather([6, 2], slab)
    PoolView(dst, layout).scatter([1, 5], slab)
    assert torch.equal(dst.kv_tensor()[:, :, [1, 5]], src.kv_tensor()[:, :, [6, 2]])


def test_run_slices_are_the_pool_slices_in_layer_then_k_v_order():
    kv = torch.arange(3 * 2 * 10 * 4, dtype=torch.float32).view(3, 2, 10, 4)
    pieces = run_slices(kv, 4, 3)
    assert len(pieces) == 6
    for i, piece in enumerate(pieces):
        want = kv[i // 2, i % 2, 4:7]
        assert piece.is_contiguous() and piece.data_ptr() == want.data_ptr()
        assert torch.equal(piece, want)


def test_slab_pool_reuses_a_given_slab_and_grows_for_a_larger_part():
    layout = layout_of()
    pool = SlabPool(layout, 0, layout.bytes_per_block)
    slab = pool.take(layout.bytes_per_block)
    pool.give(slab)
    assert pool.take(layout.bytes_per_block) is slab
    pool.give(slab)
    big = pool.take(3 * layout.bytes_per_block)
    assert big is not slab and big.capacity >= 3 * layout.bytes_per_block


def test_pushes_beyond_the_inline_sends_in_flight_still_arrive_and_are_reaped():
    """Each push of an idle link issues its frame inline and leaves the send in flight (no
    sender wake-up); once max_in_flight_parts are, push hands over to the sender thread.
    Sends issued inline are reaped when the consumer's End arrives."""
    layout = layout_of()
    hub = MockHub()
    cfg = TransferConfig(stall_timeout_s=5.0, max_in_flight_parts=2)
    src = random_store(layout, 16, seed=3)
    dst = TensorKVStore(layout, 16)
    consumer = KVConsumer(dst, location=Location("n0", "cpu"), config=cfg, backend=MockBackend(hub))
    producer = KVProducer(src, location=Location("n0", "cpu"), config=cfg, backend=MockBackend(hub))
    try:
        slots = [8, 9, 10, 11, 12, 13]
        producer.begin(consumer.expect("r", slots))
        deadline = time.monotonic() + 10
        link = None
        while time.monotonic() < deadline and (link is None or not link._connected):
            link = next(iter(producer._links.values()), None)
            time.sleep(0.005)
        for source in [1, 2, 3, 4, 5, 6]:  # one block per push, as chunks finish
            producer.push("r", [source])
        assert wait_terminal(producer, "r", 10).state is TransferState.DONE
        assert wait_terminal(consumer, "r", 10).state is TransferState.DONE
        assert torch.equal(dst.read_blocks(slots), src.read_blocks([1, 2, 3, 4, 5, 6]))
        while time.monotonic() < deadline and link._in_flight:
            time.sleep(0.005)
        assert not link._in_flight
        # An idle link: the one push goes inline; only the End has its send reaped.
        producer.begin(consumer.expect("r2", [14]))
        while time.monotonic() < deadline and link._queued:  # the Open is on its way
            time.sleep(0.005)
        producer.push("r2", [7])
        assert wait_terminal(producer, "r2", 10).state is TransferState.DONE
        assert torch.equal(dst.read_blocks([14]), src.read_blocks([7]))
        while time.monotonic() < deadline and link._in_flight:
            time.sleep(0.005)
        assert not link._in_flight
    finally:
        producer.close()
        consumer.close()

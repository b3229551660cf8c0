"""Pool runs, gathers and (layer-major) scatters, staging slabs, checksums, and the channel
semantics the protocol
relies on (as the mock implements them): receives matched per tag in posting order, messages
smaller than their receive, a message for a dropped receive and a timed-out wait breaking
the pipe."""

from __future__ import annotations

import gc
import threading
import time
import zlib

import pytest
import torch

from kvtransfer import (
    KVConsumer,
    KVLayout,
    KVLocation,
    KVProducer,
    MockBackend,
    MockHub,
    TensorKVStore,
    TransferConfig,
    TransferState,
)
from kvtransfer.backend import ChannelError
from kvtransfer.buffers import PoolView, SlabPool, crc32
from kvtransfer.testing import wait_terminal

torch.set_num_threads(1)


def layout_of(dtype: torch.dtype = torch.float32) -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, dtype=dtype,
                    device=torch.device("cpu"))


def random_store(layout: KVLayout, num_blocks: int, seed: int, *,
                 layer_major: bool = False) -> TensorKVStore:
    store = TensorKVStore(layout, num_blocks, layer_major=layer_major)
    gen = torch.Generator().manual_seed(seed)
    store.kv_tensor().copy_(torch.randn(store.kv_tensor().shape, generator=gen).to(layout.dtype))
    return store


def channel_pair():
    hub = MockHub()
    a, b = MockBackend(hub), MockBackend(hub)
    address = a.listen("127.0.0.1")
    b.listen("127.0.0.1")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "consumer", b.open_channel(address, "p", 1, torch.device("cpu"), "127.0.0.1", 5,
                                   secret="s")))
    t.start()
    producer = a.open_channel(address, "p", 0, torch.device("cpu"), "127.0.0.1", 5, secret="s")
    t.join()
    return producer, result["consumer"]


def test_a_run_of_the_pool_is_one_contiguous_view_of_it():
    layout = layout_of()
    store = random_store(layout, 8, seed=1)
    run = PoolView(store).run(2, 3)
    assert run.is_contiguous() and run.shape == layout.group_shape(3)
    assert run.data_ptr() == store.kv_tensor()[2].data_ptr()
    run.zero_()
    assert not store.read_blocks([2, 3, 4]).any() and store.read_blocks([1, 5]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gather_copies_scattered_blocks_in_order(dtype):
    layout = layout_of(dtype)
    src = random_store(layout, 16, seed=2)
    ids = [3, 4, 5, 9, 1, 2, 15]  # runs and single blocks, in the order asked
    slab = SlabPool(layout, 8).take()
    message = PoolView(src).gather(ids, slab)
    assert message.dtype == torch.uint8 and message.numel() == len(ids) * layout.bytes_per_block
    assert message.data_ptr() == slab.tensor.data_ptr()
    assert torch.equal(message, src.read_blocks(ids).view(torch.uint8).reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("ids", [[4, 5, 6], [3, 4, 5, 9, 1, 2, 15], [7]])
def test_gather_from_a_layer_major_pool_is_the_wire_layout(dtype, ids):
    layout = layout_of(dtype)
    src = random_store(layout, 16, seed=4, layer_major=True)
    slab = SlabPool(layout, 8).take()
    message = PoolView(src).gather(ids, slab)
    assert message.numel() == len(ids) * layout.bytes_per_block
    assert message.data_ptr() == slab.tensor.data_ptr()
    assert torch.equal(message, src.read_blocks(ids).view(torch.uint8).reshape(-1))
    # the same bytes a block-major pool holding the same blocks sends
    twin = TensorKVStore(layout, 16)
    twin.kv_tensor().copy_(src.read_blocks(range(16)))
    assert torch.equal(message, PoolView(twin).gather(ids, SlabPool(layout, 8).take()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_writes_a_slab_into_a_run_of_layer_major_slots_only(dtype):
    layout = layout_of(dtype)
    src = random_store(layout, 16, seed=5)
    dst = TensorKVStore(layout, 12, layer_major=True)
    slab = SlabPool(layout, 4).take()
    PoolView(src).gather([9, 2, 14], slab)  # a block-major gather: the wire layout
    PoolView(dst).scatter(slab, 6, 3)
    assert torch.equal(dst.read_blocks([6, 7, 8]), src.read_blocks([9, 2, 14]))
    assert not dst.read_blocks([0, 1, 2, 3, 4, 5, 9, 10, 11]).any()


def test_slab_pool_reuses_a_given_slab():
    layout = layout_of()
    pool = SlabPool(layout, 4)
    slab = pool.take()
    assert slab.tensor.numel() == 4 * layout.bytes_per_block
    assert slab.message(2) is slab.message(2)
    pool.give(slab)
    assert pool.take() is slab
    assert pool.take() is not slab


def test_crc32_is_over_the_bytes():
    data = torch.arange(10, dtype=torch.float32)
    assert crc32(data) == zlib.crc32(data.numpy().tobytes())


def test_receives_match_messages_per_tag_in_posting_order():
    producer, consumer = channel_pair()
    first, second = torch.zeros(4), torch.zeros(4)
    w1, w2 = consumer.recv(first, 20), consumer.recv(second, 20)
    other = torch.zeros(2)
    w3 = consumer.recv(other, 21)
    producer.send(torch.full((2,), 9.0), 21)
    producer.send(torch.full((4,), 1.0), 20)
    producer.send(torch.full((2,), 2.0), 20)  # smaller than its receive: the rest untouched
    for w in (w1, w2, w3):
        w.wait(1.0)
    assert first.tolist() == [1, 1, 1, 1] and second.tolist() == [2, 2, 0, 0]
    assert other.tolist() == [9, 9]


def test_a_message_for_a_dropped_receive_breaks_the_pipe():
    """gloo cannot deliver or skip such a message and wedges the pair; the mock fails loudly."""
    producer, consumer = channel_pair()
    target = torch.zeros(4)
    work = consumer.recv(target, 30)
    del work
    gc.collect()
    with pytest.raises(ChannelError, match="cancelled receive"):
        producer.send(torch.ones(4), 30)
    assert not target.any()
    with pytest.raises(ChannelError):
        consumer.recv(torch.zeros(1), 31)


def test_a_wait_that_times_out_closes_the_pipe_and_close_wakes_waiters():
    producer, consumer = channel_pair()
    with pytest.raises(ChannelError) as info:
        consumer.recv(torch.zeros(1), 40).wait(0.01)
    assert info.value.timed_out
    with pytest.raises(ChannelError):
        producer.send(torch.zeros(1), 40)
    producer, consumer = channel_pair()
    work = consumer.recv(torch.zeros(1), 41)
    errors = []
    waiter = threading.Thread(target=lambda: _wait_into(work, errors))
    waiter.start()
    time.sleep(0.05)
    consumer.close()
    waiter.join(2.0)
    assert not waiter.is_alive() and errors and not errors[0].timed_out


def _wait_into(work, errors):
    try:
        work.wait(60.0)
    except ChannelError as exc:
        errors.append(exc)


def test_pushes_beyond_the_inline_sends_in_flight_still_arrive_and_are_reaped():
    """Each push of an idle link sends its segment from push() itself and leaves the send in
    flight (no sender wake-up); past max_in_flight_parts push hands over to the sender
    thread. Sends issued inline are reaped when the consumer's End arrives."""
    layout = layout_of()
    hub = MockHub()
    cfg = TransferConfig(stall_timeout_s=5.0, max_in_flight_parts=2,
                         part_bytes=layout.bytes_per_block)  # one block per segment
    src = random_store(layout, 16, seed=3)
    dst = TensorKVStore(layout, 16)
    consumer = KVConsumer(dst, location=KVLocation("n0", "cpu"), config=cfg, backend=MockBackend(hub))
    producer = KVProducer(src, location=KVLocation("n0", "cpu"), config=cfg, backend=MockBackend(hub))
    try:
        slots = [8, 9, 10, 11, 12, 13]
        producer.begin(consumer.expect("r", slots))
        time.sleep(0.2)  # Ready
        producer.push("r", [1, 2, 3, 4, 5, 6])  # six segments: two inline, four by the thread
        assert wait_terminal(producer, "r", 10).state is TransferState.DONE
        assert wait_terminal(consumer, "r", 10).state is TransferState.DONE
        assert torch.equal(dst.read_blocks(slots), src.read_blocks([1, 2, 3, 4, 5, 6]))
        [stats] = producer.drain_stats()
        assert stats.num_blocks == 6 and stats.num_bytes == 6 * layout.bytes_per_block
    finally:
        producer.close()
        consumer.close()

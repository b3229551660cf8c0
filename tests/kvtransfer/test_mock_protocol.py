"""The protocol over the in-process mock backend: the same endpoints, states and failures as
over torch.distributed, for the layers above (worker actors) to test against."""

from __future__ import annotations

import time
from dataclasses import replace

import msgpack
import pytest
import torch

from kvtransfer import (
    FailReason,
    KVConsumer,
    KVLayout,
    KVLocation,
    KVProducer,
    MockBackend,
    MockHub,
    Side,
    TensorKVStore,
    TopologyClass,
    TransferConfig,
    TransferState,
)
from kvtransfer.testing import wait_terminal
from scheduler.messages import KVTicket, decode, encode

torch.set_num_threads(1)

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, dtype=torch.float32,
                  device=torch.device("cpu"))
WAIT = 20.0


def make_pair(config: TransferConfig | None = None, *, producer_loc=None, consumer_loc=None,
              producer_layer_major: bool = False, consumer_layer_major: bool = False):
    hub = MockHub()
    cfg = config or TransferConfig(stall_timeout_s=1.5, start_timeout_s=2.5,
                                   part_bytes=2 * LAYOUT.bytes_per_block)
    src = TensorKVStore(LAYOUT, 32, fill="random", layer_major=producer_layer_major)
    dst = TensorKVStore(LAYOUT, 32, layer_major=consumer_layer_major)
    consumer = KVConsumer(dst, location=consumer_loc or KVLocation("n0", "cpu"), config=cfg,
                          backend=MockBackend(hub))
    producer = KVProducer(src, location=producer_loc or KVLocation("n0", "cpu"), config=cfg,
                          backend=MockBackend(hub))
    return src, dst, consumer, producer


@pytest.fixture
def pair():
    src, dst, consumer, producer = make_pair()
    yield src, dst, consumer, producer
    producer.close()
    consumer.close()


def test_blocks_stream_into_the_reserved_slots(pair):
    src, dst, consumer, producer = pair
    ticket = consumer.expect("r1", [4, 9, 2, 7, 11])
    assert decode(encode(ticket), expect=KVTicket) == ticket  # as the control plane carries it
    producer.begin(ticket)
    assert producer.poll("r1").state is TransferState.PENDING
    producer.push("r1", [0, 1])
    producer.push("r1", [5, 6, 3])
    assert wait_terminal(producer, "r1", WAIT).state is TransferState.DONE
    status = consumer.poll("r1")
    assert (status.state, status.num_blocks_done, status.num_blocks_total) == (TransferState.DONE, 5, 5)
    assert torch.equal(dst.read_blocks([4, 9, 2, 7, 11]), src.read_blocks([0, 1, 5, 6, 3]))


def test_checksummed_parts_arrive_intact():
    cfg = TransferConfig(stall_timeout_s=2.0, part_bytes=LAYOUT.bytes_per_block, checksum=True)
    src, dst, consumer, producer = make_pair(cfg)
    try:
        producer.begin(consumer.expect("r", [1, 2, 3]))
        producer.push("r", [7, 8, 9])
        assert wait_terminal(consumer, "r", WAIT).state is TransferState.DONE
        assert torch.equal(dst.read_blocks([1, 2, 3]), src.read_blocks([7, 8, 9]))
    finally:
        producer.close()
        consumer.close()


def test_prefix_hits_at_the_consumer_are_not_sent(pair):
    src, dst, consumer, producer = pair
    producer.begin(consumer.expect("r2", [1, 2, 3, 4], present=[0, 1]))
    producer.push("r2", [20, 21, 22, 23])  # the whole prompt, as the prefill engine reports it
    assert wait_terminal(consumer, "r2", WAIT).state is TransferState.DONE
    assert torch.equal(dst.read_blocks([3, 4]), src.read_blocks([22, 23]))
    assert not dst.read_blocks([1, 2]).any()
    [stats] = [s for s in producer.drain_stats() if s.req_id == "r2"]
    assert (stats.num_blocks, stats.num_skipped_blocks) == (2, 2)
    assert stats.num_bytes == 2 * LAYOUT.bytes_per_block


def test_push_may_skip_only_present_positions(pair):
    src, dst, consumer, producer = pair
    producer.begin(consumer.expect("r3", [1, 2, 3, 4], present=[0, 1]))
    producer.push("r3", [22, 23], first_position=2)  # the producer's own prefix hits skipped
    assert wait_terminal(consumer, "r3", WAIT).state is TransferState.DONE
    producer.begin(consumer.expect("r4", [5, 6, 7], present=[0]))
    with pytest.raises(ValueError, match="not present"):
        producer.push("r4", [1], first_position=2)
    with pytest.raises(ValueError, match="reservation has 3"):
        producer.push("r4", [1, 2, 3, 4])
    with pytest.raises(ValueError, match="begin"):
        producer.push("nope", [1])


def test_fully_present_prompt_is_done_without_a_transfer(pair):
    _, _, consumer, producer = pair
    ticket = consumer.expect("r5", [1, 2], present=[0, 1])
    assert consumer.poll("r5").state is TransferState.DONE
    producer.begin(ticket)
    assert producer.poll("r5").state is TransferState.DONE
    assert producer.peers() == []  # no group was opened for it


def test_bad_expect_and_ticket_are_refused(pair):
    _, _, consumer, producer = pair
    with pytest.raises(ValueError):
        consumer.expect("r6", [1, 1])
    with pytest.raises(ValueError):
        consumer.expect("r6", [1, 2], present=[2])
    consumer.expect("r6", [1, 2])
    with pytest.raises(ValueError, match="already exists"):
        consumer.expect("r6", [3])
    with pytest.raises(ValueError, match="KVTicket"):
        producer.begin({"req_id": "r6"})
    with pytest.raises(ValueError, match="block_ids"):
        producer.begin(replace(consumer.expect("r7", [4]), block_ids=("x",)))


def test_abort_from_either_side_mirrors_on_the_other(pair):
    _, dst, consumer, producer = pair
    producer.begin(consumer.expect("a1", [1, 2, 3]))
    producer.push("a1", [5])
    assert consumer.abort("a1")
    status = wait_terminal(producer, "a1", WAIT)
    assert (status.state, status.failed_side) == (TransferState.ABORTED, Side.CONSUMER)
    assert not consumer.abort("a1")  # already terminal
    producer.begin(consumer.expect("a2", [4, 5]))
    assert producer.abort("a2")
    status = wait_terminal(consumer, "a2", WAIT)
    assert (status.state, status.failed_side) == (TransferState.ABORTED, Side.PRODUCER)
    assert not dst.read_blocks([4, 5]).any()


def test_forget_needs_a_terminal_state(pair):
    _, _, consumer, producer = pair
    consumer.expect("f1", [1])
    with pytest.raises(ValueError, match="abort it first"):
        consumer.forget("f1")
    consumer.abort("f1")
    assert consumer.forget("f1").state is TransferState.ABORTED
    assert consumer.poll("f1") is None
    consumer.expect("f1", [1])  # the id can be reused once forgotten


def test_stalled_producer_times_out_on_both_sides(pair):
    _, _, consumer, producer = pair
    producer.begin(consumer.expect("s1", [1, 2, 3]))
    producer.push("s1", [4])
    c = wait_terminal(consumer, "s1", WAIT)
    p = wait_terminal(producer, "s1", WAIT)
    assert (c.state, c.reason, c.failed_side) == (TransferState.FAILED, FailReason.TIMEOUT, Side.PRODUCER)
    assert (p.state, p.reason, p.failed_side) == (TransferState.FAILED, FailReason.TIMEOUT, Side.PRODUCER)


def test_producer_that_never_starts_times_out(pair):
    _, _, consumer, _ = pair
    consumer.expect("s2", [1])
    status = wait_terminal(consumer, "s2", WAIT)
    assert (status.state, status.reason) == (TransferState.FAILED, FailReason.TIMEOUT)
    assert "start" in status.detail


def test_keepalive_vouches_only_for_blocks_still_to_come(pair):
    """True while a live transfer waits for pushes; nothing to vouch for otherwise."""
    _, _, consumer, producer = pair
    assert not producer.keepalive("k-unknown")
    producer.begin(consumer.expect("k1", [1, 2, 3]))
    assert producer.keepalive("k1")  # queued: nothing pushed yet
    producer.push("k1", [4])
    assert producer.keepalive("k1")  # paused between chunks
    producer.push("k1", [5, 6])
    assert not producer.keepalive("k1")  # every block pushed: the sends are what is left
    assert wait_terminal(consumer, "k1", WAIT).state is TransferState.DONE
    producer.begin(consumer.expect("k2", [7, 8]))
    producer.abort("k2")
    assert not producer.keepalive("k2")


def test_a_transfer_kept_alive_waits_past_both_timeouts():
    """Queued past the start timeout, then paused between chunks past the stall timeout,
    while the producer's caller keeps it alive (every turn of its loop): both sides stay
    live and it completes; left without keepalives it fails as before."""
    src, dst, consumer, producer = make_pair(TransferConfig(
        stall_timeout_s=0.3, start_timeout_s=0.3, part_bytes=LAYOUT.bytes_per_block))
    try:
        producer.begin(consumer.expect("kept", [1, 2, 3]))
        _vouch(producer, "kept", 1.0)  # more than three times either timeout
        producer.push("kept", [4])
        assert _wait_done(consumer, "kept", 1)
        _vouch(producer, "kept", 1.0)
        assert consumer.poll("kept").state is TransferState.TRANSFERRING
        producer.push("kept", [5, 6])
        assert wait_terminal(consumer, "kept", WAIT).state is TransferState.DONE
        assert wait_terminal(producer, "kept", WAIT).state is TransferState.DONE
        assert torch.equal(dst.read_blocks([1, 2, 3]), src.read_blocks([4, 5, 6]))
        producer.begin(consumer.expect("left", [9, 10]))
        producer.push("left", [11])
        status = wait_terminal(consumer, "left", WAIT)
        assert (status.state, status.reason) == (TransferState.FAILED, FailReason.TIMEOUT)
    finally:
        producer.close()
        consumer.close()


def _vouch(producer: KVProducer, req_id: str, seconds: float) -> None:
    """The prefill worker's loop while the policy holds the prompt back: a keepalive every
    turn (about 20 ms here) for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert producer.keepalive(req_id)
        time.sleep(0.02)


def test_consumer_leaving_ends_the_producer_side():
    _, _, consumer, producer = make_pair()
    try:
        producer.begin(consumer.expect("l1", [1, 2]))
        producer.push("l1", [3])
        assert wait_terminal(consumer, "l1", 0.2).num_blocks_done <= 1
        consumer.close()
        status = wait_terminal(producer, "l1", WAIT)
        assert status.state is TransferState.ABORTED and status.failed_side is Side.CONSUMER
        assert producer.peers() == []
    finally:
        producer.close()


def test_unknown_request_is_refused_on_both_ends(pair):
    _, _, consumer, producer = pair
    ticket = consumer.expect("u1", [1])
    producer.begin(replace(ticket, req_id="u-ghost"))
    status = wait_terminal(producer, "u-ghost", WAIT)
    assert (status.state, status.reason) == (TransferState.FAILED, FailReason.UNKNOWN_REQUEST)


def test_layout_mismatch_fails_at_begin(pair):
    _, _, consumer, _ = pair
    other = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2,
                     dtype=torch.bfloat16, device=torch.device("cpu"))
    producer = KVProducer(TensorKVStore(other, 4), location=KVLocation("n0"),
                          backend=MockBackend(MockHub()))
    try:
        producer.begin(consumer.expect("m1", [1]))
        status = producer.poll("m1")
        assert (status.state, status.reason) == (TransferState.FAILED, FailReason.MISMATCH)
    finally:
        producer.close()


@pytest.mark.parametrize(
    ("producer_loc", "consumer_loc", "topology"),
    [
        (KVLocation("n0", "cuda:0", "d0"), KVLocation("n0", "cuda:0", "d0"), TopologyClass.SAME_DEVICE),
        (KVLocation("n0", "cuda:0", "d0"), KVLocation("n0", "cuda:1", "d0"), TopologyClass.SAME_DOMAIN),
        (KVLocation("n0", "cuda:0", "d0"), KVLocation("n0", "cuda:4", "d1"), TopologyClass.SAME_NODE),
        (KVLocation("n0", "cpu"), KVLocation("n1", "cpu"), TopologyClass.CROSS_NODE),
        # two CPU pools never share a device: a block crosses a socket between them
        (KVLocation("n0", "cpu"), KVLocation("n0", "cpu"), TopologyClass.SAME_NODE),
        (KVLocation("n0", "cpu", "n0/host"), KVLocation("n0", "cpu", "n0/host"),
         TopologyClass.SAME_DOMAIN),
    ],
)
def test_every_transfer_records_its_topology_bytes_and_duration(producer_loc, consumer_loc, topology):
    src, dst, consumer, producer = make_pair(producer_loc=producer_loc, consumer_loc=consumer_loc)
    try:
        producer.begin(consumer.expect("t1", [1, 2, 3]))
        producer.push("t1", [4, 5, 6])
        assert wait_terminal(producer, "t1", WAIT).state is TransferState.DONE
        for stats in (producer.drain_stats(), consumer.drain_stats()):
            [record] = stats
            assert record.topology is topology
            assert record.num_bytes == 3 * LAYOUT.bytes_per_block and record.duration_s >= 0
            assert record.backend == "mock" and record.state is TransferState.DONE
            assert msgpack.unpackb(msgpack.packb(record.to_dict()))["topology"] == topology.value
    finally:
        producer.close()
        consumer.close()


def test_one_producer_serves_many_consumers():
    hub = MockHub()
    src = TensorKVStore(LAYOUT, 16, fill="random")
    producer = KVProducer(src, location=KVLocation("n0"), backend=MockBackend(hub))
    stores = [TensorKVStore(LAYOUT, 8) for _ in range(3)]
    consumers = [KVConsumer(store, location=KVLocation("n0"), backend=MockBackend(hub))
                 for store in stores]
    try:
        for i, consumer in enumerate(consumers):
            producer.begin(consumer.expect(f"m{i}", [1, 2]))
            producer.push(f"m{i}", [i, i + 5])
        for i, consumer in enumerate(consumers):
            assert wait_terminal(consumer, f"m{i}", WAIT).state is TransferState.DONE
            assert torch.equal(stores[i].read_blocks([1, 2]), src.read_blocks([i, i + 5]))
        assert len(producer.peers()) == 3
        assert producer.disconnect(consumers[0].endpoint_id)
        assert len(producer.peers()) == 2
    finally:
        producer.close()
        for consumer in consumers:
            consumer.close()


def test_segments_arrive_whatever_the_sources_and_slots():
    """Slots cut into segments (runs of consecutive slots, at most part_bytes); each segment
    goes from the source pool when its sources are consecutive too, else staged."""
    cfg = TransferConfig(stall_timeout_s=2.0, part_bytes=3 * LAYOUT.bytes_per_block)
    src, dst, consumer, producer = make_pair(cfg)
    try:
        slots = [10, 11, 12, 13, 3, 8, 5, 6]  # segments [10-12] [13] [3] [8] [5, 6]
        ticket = consumer.expect("d1", slots)
        assert ticket.segment_blocks == 3
        producer.begin(ticket)
        producer.push("d1", [20, 21, 22, 23, 1, 2])  # a run of sources, then scattered ones
        producer.push("d1", [9, 7])  # the last segment's sources are in reverse order
        assert wait_terminal(producer, "d1", WAIT).state is TransferState.DONE
        assert wait_terminal(consumer, "d1", WAIT).state is TransferState.DONE
        assert torch.equal(dst.read_blocks(slots), src.read_blocks([20, 21, 22, 23, 1, 2, 9, 7]))
        assert not dst.read_blocks([0, 1, 2, 4, 7, 9]).any()
    finally:
        producer.close()
        consumer.close()


def test_a_segment_waits_for_its_last_block():
    src, dst, consumer, producer = make_pair()  # two blocks per segment
    producer.begin(consumer.expect("w1", [1, 2, 3]))
    producer.push("w1", [4])
    time.sleep(0.2)
    assert consumer.poll("w1").num_blocks_done == 0  # segment [1, 2] is not complete
    producer.push("w1", [5])
    assert _wait_done(consumer, "w1", 2)
    producer.push("w1", [6])
    assert wait_terminal(consumer, "w1", WAIT).state is TransferState.DONE
    assert torch.equal(dst.read_blocks([1, 2, 3]), src.read_blocks([4, 5, 6]))
    producer.close()
    consumer.close()


def test_consumer_abort_of_a_posted_transfer_ends_once_its_receives_are_released(pair):
    src, dst, consumer, producer = pair
    producer.begin(consumer.expect("c1", [1, 2, 3, 4]))
    producer.push("c1", [5, 6])  # the first segment lands
    assert _wait_done(consumer, "c1", 2)
    assert consumer.abort("c1")
    assert not consumer.abort("c1")  # already ending
    status = wait_terminal(consumer, "c1", WAIT)  # the producer released the posted receive
    assert (status.state, status.failed_side) == (TransferState.ABORTED, Side.CONSUMER)
    assert wait_terminal(producer, "c1", WAIT).state is TransferState.ABORTED
    producer.push("c1", [7, 8])  # the prefill side finishes anyway: nothing is sent
    time.sleep(0.2)
    assert not dst.read_blocks([3, 4]).any()
    # the pair goes on serving others
    producer.begin(consumer.expect("c2", [9]))
    producer.push("c2", [10])
    assert wait_terminal(consumer, "c2", WAIT).state is TransferState.DONE


@pytest.mark.parametrize("layer_major", [False, True], ids=["block-major", "layer-major"])
@pytest.mark.parametrize("pushed", [0, 1, 2, 3, 5])
def test_every_posted_receive_gets_one_message_whenever_the_consumer_aborts(pushed, layer_major):
    """Segments sent, then the abort: the producer releases each receive not yet served (a
    message for a dropped receive would break the mock's pipe), and the pair keeps working.
    Both sides layer-major: two slabs take the five segments in turn, and an empty release
    landing in a slab that still holds an earlier segment scatters nothing."""
    cfg = TransferConfig(stall_timeout_s=2.0, part_bytes=LAYOUT.bytes_per_block,  # 1 a segment
                         max_in_flight_parts=2)
    src, dst, consumer, producer = make_pair(cfg, producer_layer_major=layer_major,
                                             consumer_layer_major=layer_major)
    try:
        producer.begin(consumer.expect("e1", [1, 2, 3, 4, 5]))
        time.sleep(0.05)
        producer.push("e1", list(range(10, 10 + pushed)))
        aborted = consumer.abort("e1")  # False: every segment landed first
        state = wait_terminal(consumer, "e1", WAIT).state
        assert state is (TransferState.ABORTED if aborted else TransferState.DONE)
        assert wait_terminal(producer, "e1", WAIT).state.is_terminal
        assert not dst.read_blocks(list(range(1 + pushed, 6))).any()  # never sent: untouched
        producer.begin(consumer.expect("e2", [6, 7]))
        producer.push("e2", [20, 21])
        assert wait_terminal(consumer, "e2", WAIT).state is TransferState.DONE
        assert torch.equal(dst.read_blocks([6, 7]), src.read_blocks([20, 21]))
    finally:
        producer.close()
        consumer.close()


def _wait_done(endpoint, req_id: str, n: int) -> bool:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        status = endpoint.poll(req_id)
        if status is not None and status.num_blocks_done >= n:
            return True
        time.sleep(0.005)
    return False


def test_a_request_id_can_come_back_right_after_its_transfer_ended(pair):
    """Router retries reuse request ids: a late End of the earlier transfer (told apart by
    its tag) must not end the new one."""
    src, dst, consumer, producer = pair
    for _ in range(5):
        producer.begin(consumer.expect("x", [1, 2, 3]))
        producer.push("x", [4])
        assert producer.abort("x")
        assert wait_terminal(consumer, "x", WAIT).state is TransferState.ABORTED
        consumer.forget("x")
        producer.forget("x")
    ticket = consumer.expect("x", [5, 6, 7])
    producer.begin(ticket)
    producer.push("x", [8, 9, 10])
    assert wait_terminal(producer, "x", WAIT).state is TransferState.DONE
    assert wait_terminal(consumer, "x", WAIT).state is TransferState.DONE
    assert torch.equal(dst.read_blocks([5, 6, 7]), src.read_blocks([8, 9, 10]))


# (producer, consumer) pool layouts, layer-major or not
CROSS_LAYOUTS = [(False, True), (True, False), (True, True)]
CROSS_IDS = ["block-to-layer", "layer-to-block", "layer-to-layer"]


@pytest.mark.parametrize("checksum", [False, True], ids=["posted", "announced"])
@pytest.mark.parametrize(("producer_layer_major", "consumer_layer_major"), CROSS_LAYOUTS,
                         ids=CROSS_IDS)
def test_blocks_land_byte_identical_whatever_the_pool_layouts(producer_layer_major,
                                                              consumer_layer_major, checksum):
    """The wire layout is the same from and into either pool layout: runs and scattered
    sources, runs and scattered slots, more segments than the consumer's staging window."""
    cfg = TransferConfig(stall_timeout_s=2.0, part_bytes=3 * LAYOUT.bytes_per_block,
                         max_in_flight_parts=2, checksum=checksum)
    src, dst, consumer, producer = make_pair(cfg, producer_layer_major=producer_layer_major,
                                             consumer_layer_major=consumer_layer_major)
    try:
        slots = [10, 11, 12, 13, 3, 8, 5, 6, 20, 21, 22]  # [10-12] [13] [3] [8] [5, 6] [20-22]
        sources = [20, 21, 22, 23, 1, 2, 9, 7, 14, 16, 15]  # runs, scattered, reversed
        producer.begin(consumer.expect("x1", slots, present=[5]))
        producer.push("x1", sources[:6])
        producer.push("x1", sources[6:])
        assert wait_terminal(producer, "x1", WAIT).state is TransferState.DONE
        assert wait_terminal(consumer, "x1", WAIT).state is TransferState.DONE
        sent = [i for i in range(len(slots)) if i != 5]
        assert torch.equal(dst.read_blocks([slots[i] for i in sent]),
                           src.read_blocks([sources[i] for i in sent]))
        untouched = [b for b in range(32) if b not in slots or b == 8]
        assert not dst.read_blocks(untouched).any()
        [stats] = consumer.drain_stats()
        assert stats.num_bytes == 10 * LAYOUT.bytes_per_block
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize(("producer_layer_major", "consumer_layer_major"), CROSS_LAYOUTS,
                         ids=CROSS_IDS)
def test_a_cancel_mid_transfer_leaves_unsent_slots_alone_whatever_the_layouts(
        producer_layer_major, consumer_layer_major):
    cfg = TransferConfig(stall_timeout_s=2.0, part_bytes=LAYOUT.bytes_per_block,
                         max_in_flight_parts=2)
    src, dst, consumer, producer = make_pair(cfg, producer_layer_major=producer_layer_major,
                                             consumer_layer_major=consumer_layer_major)
    try:
        producer.begin(consumer.expect("y1", [1, 2, 3, 4, 5, 6]))
        producer.push("y1", [7, 8, 9])
        assert _wait_done(consumer, "y1", 3)
        assert producer.abort("y1")
        status = wait_terminal(consumer, "y1", WAIT)
        assert (status.state, status.failed_side) == (TransferState.ABORTED, Side.PRODUCER)
        assert torch.equal(dst.read_blocks([1, 2, 3]), src.read_blocks([7, 8, 9]))
        assert not dst.read_blocks([4, 5, 6]).any()
        producer.begin(consumer.expect("y2", [4, 5, 6]))
        producer.push("y2", [10, 11, 12])
        assert wait_terminal(consumer, "y2", WAIT).state is TransferState.DONE
        assert torch.equal(dst.read_blocks([4, 5, 6]), src.read_blocks([10, 11, 12]))
    finally:
        producer.close()
        consumer.close()

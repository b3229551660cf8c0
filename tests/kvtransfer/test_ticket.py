"""The KV ticket as a typed message: it round-trips through the control plane's codec inside
the messages that carry it, and a producer refuses a malformed one field by field (it comes
from another process)."""

from __future__ import annotations

from dataclasses import replace

import msgpack
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
    TransferState,
)
from kvtransfer.ticket import MAX_ID_CHARS, MAX_TICKET_BLOCKS, check_ticket
from scheduler.messages import (
    GenerationSpec,
    KVEndpoint,
    KVPoolShape,
    KVServer,
    KVTicket,
    MessageError,
    MigrateAnswer,
    SamplingSpec,
    StartPrefill,
    TransferStat,
    decode,
    encode,
)
from scheduler.messages import (
    KVLocation as MessageLocation,
)
from scheduler.topology import TopologyClass

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float32,
                  device=torch.device("cpu"))
ENDPOINT = KVEndpoint("c-1", "mock", KVServer("hub-1", 3), KVLocation("n0", "cpu", "n0/host"),
                      KVPoolShape(2, 1, 4, 2, "float32"))
TICKET = KVTicket("r1", (4, 9, 2), (0,), 17, 2, ENDPOINT, "s3cret")
SPEC = GenerationSpec("r1", (1, 2, 3), SamplingSpec(max_tokens=4), 0, "t", 1.0)


def test_kvtransfer_location_is_the_message_type():
    assert KVLocation is MessageLocation


@pytest.mark.parametrize("msg", [
    TICKET,
    replace(TICKET, present=(), consumer=replace(ENDPOINT, location=KVLocation("n1"))),
    StartPrefill(SPEC, "decode-0", TICKET),
    MigrateAnswer("r1", TICKET, num_cached_blocks=1),
    MigrateAnswer("r1", None, reason="no room"),
    TransferStat("r1", 1024, 0.5, 10.0, TopologyClass.SAME_DOMAIN),
])
def test_messages_that_carry_kv_values_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_a_real_ticket_round_trips_and_passes_the_check():
    hub = MockHub()
    consumer = KVConsumer(TensorKVStore(LAYOUT, 8), location=KVLocation("n0"),
                          backend=MockBackend(hub))
    try:
        ticket = consumer.expect("r", [5, 6, 7], present=[0])
        got = decode(encode(StartPrefill(SPEC, "d", ticket)), expect=StartPrefill).ticket
        assert got == ticket and check_ticket(got) is got
        assert (got.block_ids, got.present, got.consumer) == ((5, 6, 7), (0,), consumer.address())
    finally:
        consumer.close()


def test_the_codec_refuses_a_ticket_of_the_wrong_types():
    wire = msgpack.unpackb(encode(TICKET))
    wire[2] = ["4", 9]  # block ids as strings
    with pytest.raises(MessageError, match="block_ids"):
        decode(msgpack.packb(wire), expect=KVTicket)
    wire = msgpack.unpackb(encode(TICKET))
    wire[6] = {"endpoint_id": "c-1"}  # a plain map where the endpoint message goes
    with pytest.raises(MessageError, match="consumer"):
        decode(msgpack.packb(wire), expect=KVTicket)


def _with_endpoint(**changes) -> KVTicket:
    return replace(TICKET, consumer=replace(ENDPOINT, **changes))


@pytest.mark.parametrize(("ticket", "field"), [
    ({"req_id": "r1"}, "KVTicket"),
    (replace(TICKET, req_id=""), "req_id"),
    (replace(TICKET, req_id="x" * (MAX_ID_CHARS + 1)), "req_id"),
    (replace(TICKET, req_id=7), "req_id"),
    (replace(TICKET, block_ids=()), "block_ids"),
    (replace(TICKET, block_ids=(1, -1)), "block_ids"),
    (replace(TICKET, block_ids=(1, 1 << 40)), "block_ids"),
    (replace(TICKET, block_ids=(1, True)), "block_ids"),
    (replace(TICKET, block_ids=(1, 1)), "block_ids"),
    (replace(TICKET, block_ids=tuple(range(MAX_TICKET_BLOCKS + 1))), "block_ids"),
    (replace(TICKET, block_ids="123"), "block_ids"),
    (replace(TICKET, present=(3,)), "present"),
    (replace(TICKET, present=(0, 0)), "present"),
    (replace(TICKET, tag=3), "tag"),
    (replace(TICKET, tag=1 << 31), "tag"),
    (replace(TICKET, segment_blocks=0), "segment_blocks"),
    (replace(TICKET, consumer={"endpoint_id": "c-1"}), "consumer"),
    (_with_endpoint(endpoint_id=""), "consumer.endpoint_id"),
    (_with_endpoint(server=KVServer("h", 70000)), "consumer.server.port"),
    (_with_endpoint(server=KVServer("", 1)), "consumer.server.host"),
    (_with_endpoint(location=KVLocation("")), "consumer.location.node_id"),
    (_with_endpoint(location=KVLocation("n0", "cpu", "")), "consumer.location.nvlink_domain"),
    (_with_endpoint(layout=KVPoolShape(0, 1, 4, 2, "float32")), "consumer.layout.num_layers"),
    (_with_endpoint(layout=KVPoolShape(2, 1, 4, 2, "complex64")), "consumer.layout.dtype"),
    (replace(TICKET, secret=""), "secret"),
])
def test_a_malformed_ticket_is_refused_naming_its_field(ticket, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        check_ticket(ticket)


def test_begin_refuses_a_malformed_ticket_before_any_record_exists():
    hub = MockHub()
    producer = KVProducer(TensorKVStore(LAYOUT, 8), location=KVLocation("n0"),
                          backend=MockBackend(hub))
    try:
        with pytest.raises(ValueError, match="tag"):
            producer.begin(replace(TICKET, tag=0))
        assert producer.poll("r1") is None and producer.peers() == []
        with pytest.raises(ValueError, match="backend"):
            producer.begin(_with_endpoint(backend="dist"))
        producer.begin(_with_endpoint(layout=KVPoolShape(2, 1, 4, 2, "bfloat16")))
        status = producer.poll("r1")  # well-formed, but another pool's geometry
        assert status.state is TransferState.FAILED and "layout" in status.detail
    finally:
        producer.close()

"""Metadata on the wire (msgpack only), the two pool layouts, the segment plan,
configuration."""

from __future__ import annotations

import msgpack
import pytest
import torch

from kvtransfer import KVLayout, KVLocation, TensorKVStore, TransferConfig, wire
from kvtransfer.buffers import Frame
from kvtransfer.layout import check_pool, is_block_major
from kvtransfer.plan import plan_segments, segment_blocks_for, ticket_digest
from kvtransfer.state import FailReason, Side, TransferState
from kvtransfer.transfers import block_runs
from scheduler.messages import KVPoolShape, KVServer, decode, encode

torch.set_num_threads(1)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.bfloat16,
                  device=torch.device("cpu"))
OPEN = wire.Open("r", 17, 2**63 + 5, 3, 2, 2, [0, 2], "bfloat16", [2, 1, 4], True)


@pytest.mark.parametrize("msg", [
    wire.Hello("p-1", "prod", KVServer("h", 1), KVLocation("n"), LAYOUT.shape(), "proof"),
    OPEN,
    wire.Ready("r", 17),
    wire.Blocks("r", 17, 0, [2, 1], [1, 2**32 - 1]),
    wire.Blocks("r", 17, 1, [1], None),
    wire.Keepalive("r", 17),
    wire.End("r", TransferState.FAILED, FailReason.TIMEOUT, Side.PRODUCER, "stalled"),
    wire.End("r", TransferState.DONE, tag=17),
    wire.Bye(),
])
def test_messages_round_trip(msg):
    assert wire.decode(wire.encode(msg)) == msg
    frame = Frame()
    wire.write_frame(msg, frame.view)
    assert wire.read_frame(frame.view) == msg


@pytest.mark.parametrize("raw", [
    b"\xc1",  # not msgpack
    msgpack.packb([1, 2]),
    msgpack.packb({"t": "pickle", "data": b"cos\nsystem"}),
    msgpack.packb({"t": "open", "req": 1, "num_blocks": 2}),
    msgpack.packb({**msgpack.unpackb(wire.encode(OPEN)), "posted": 1}),
    msgpack.packb({**msgpack.unpackb(wire.encode(OPEN)), "tag": -3}),
    msgpack.packb({"t": "blocks", "req": "r", "tag": 17, "first": 0, "sizes": [-1], "crc": None}),
    msgpack.packb({"t": "ready"}),
    msgpack.packb({"t": "keepalive", "req": "r"}),
    msgpack.packb({"t": "end", "req": "r", "state": "transferring"}),
    msgpack.packb({"t": "end", "req": "r", "state": "failed", "reason": "gremlins"}),
])
def test_malformed_messages_are_protocol_errors(raw):
    with pytest.raises(wire.ProtocolError):
        wire.decode(raw)


def test_oversized_frame_length_is_refused():
    frame = Frame()
    frame.view[:4] = (10**6).to_bytes(4, "little")
    with pytest.raises(wire.ProtocolError):
        wire.read_frame(frame.view)


def test_largest_blocks_message_fits_a_frame():
    n = wire.MAX_SEGMENTS_PER_BLOCKS
    big = wire.Blocks("r" * 64, 2**31 - 1, 10**6, [2**16] * n, [2**32 - 1] * n)
    wire.write_frame(big, Frame().view)


def test_layout_is_block_major():
    assert LAYOUT.bytes_per_block == 2 * 2 * 2 * 1 * 4 * 2
    assert LAYOUT.group_shape(3) == (3, 2, 2, 2, 1, 4)
    store = TensorKVStore(LAYOUT, 5, fill="random")
    assert store.kv_tensor()[2].is_contiguous() and store.kv_tensor()[1:4].is_contiguous()
    assert torch.equal(store.read_blocks([3, 1]), store.kv_tensor()[[3, 1]])
    assert LAYOUT.shape() == KVPoolShape(2, 1, 4, 2, "bfloat16")
    assert decode(encode(LAYOUT.shape()), expect=KVPoolShape) == LAYOUT.shape()
    with pytest.raises(ValueError):
        KVLayout(0, 1, 1, 1, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError):
        KVLayout(1, 1, 1, 1, torch.complex64, torch.device("cpu"))


def test_layer_major_store_keeps_each_layer_of_every_block_in_one_sequence():
    store = TensorKVStore(LAYOUT, 5, fill="random", layer_major=True)
    kv = store.kv_tensor()
    assert not store.block_major and not is_block_major(store)
    assert tuple(kv.shape) == LAYOUT.pool_shape(5, block_major=False) == (2, 2, 5, 2, 1, 4)
    assert kv[1, 0].is_contiguous()  # layer 1's K of every block
    blocks = store.read_blocks([3, 1])
    assert blocks.is_contiguous() and tuple(blocks.shape) == LAYOUT.group_shape(2)
    assert torch.equal(blocks[0, 1, 0], kv[1, 0, 3]) and torch.equal(blocks[1, 0, 1], kv[0, 1, 1])
    others = store.read_blocks([1, 2, 3])
    data = torch.randn(LAYOUT.group_shape(2)).to(LAYOUT.dtype)
    store.write_blocks([4, 0], data)
    assert torch.equal(store.read_blocks([0, 4]), data[[1, 0]])
    assert torch.equal(store.read_blocks([1, 2, 3]), others)
    with pytest.raises(ValueError, match="shape"):
        store.write_blocks([1], data)


class _StoreBeforeTheFlag:
    """A store written before ``block_major`` existed: only the tensor and its layout."""

    def __init__(self, kv: torch.Tensor) -> None:
        self._kv = kv

    def kv_layout(self) -> KVLayout:
        return LAYOUT

    def kv_tensor(self) -> torch.Tensor:
        return self._kv


class _FlaggedStore(_StoreBeforeTheFlag):
    def __init__(self, kv: torch.Tensor, block_major: object) -> None:
        super().__init__(kv)
        self.block_major = block_major


def test_check_pool_takes_either_layout_as_the_store_says_and_refuses_anything_else():
    block_major = torch.zeros(LAYOUT.pool_shape(6), dtype=LAYOUT.dtype)
    layer_major = torch.zeros(LAYOUT.pool_shape(6, block_major=False), dtype=LAYOUT.dtype)
    check_pool(TensorKVStore(LAYOUT, 3), LAYOUT)
    check_pool(TensorKVStore(LAYOUT, 3, layer_major=True), LAYOUT)
    check_pool(_StoreBeforeTheFlag(block_major), LAYOUT)  # no flag: block-major
    check_pool(_FlaggedStore(layer_major, False), LAYOUT)
    assert is_block_major(_StoreBeforeTheFlag(block_major))
    refused = [
        (_StoreBeforeTheFlag(layer_major), "block-major"),
        (_FlaggedStore(block_major, False), r"layer-major \[2, 2, num_blocks, 2, 1, 4\]"),
        (_FlaggedStore(torch.zeros(2, 2, 2, 6, 1, 4, dtype=LAYOUT.dtype).transpose(2, 3), False),
         "not contiguous"),
        (_FlaggedStore(layer_major.float(), False), "bfloat16"),
        (_FlaggedStore(layer_major[0], False), "got"),
    ]
    for store, message in refused:
        with pytest.raises(ValueError, match=message):
            check_pool(store, LAYOUT)
    with pytest.raises(ValueError, match="must be a bool"):
        check_pool(_FlaggedStore(layer_major, "no"), LAYOUT)


def test_segments_are_runs_of_consecutive_slots_capped_in_size():
    # positions 0-1 present; 2..5 -> slots 10..13 (a run, cut at 3), 6 -> 20, 7 -> 21 ... 8 -> 5
    segments = plan_segments([7, 8, 10, 11, 12, 13, 20, 21, 5], [0, 1], 3)
    assert [(s.positions, s.first_slot) for s in segments] == [
        ((2, 3, 4), 10), ((5,), 13), ((6, 7), 20), ((8,), 5)]
    assert [s.index for s in segments] == [0, 1, 2, 3]
    assert plan_segments([1, 2], [0, 1], 4) == []
    # a prefix hit in the middle splits nothing but is skipped
    assert [s.positions for s in plan_segments([1, 2, 3, 4], [1], 8)] == [(0,), (2, 3)]
    with pytest.raises(ValueError):
        plan_segments([1], [], 0)
    assert segment_blocks_for(8 << 20, 368_640) == 22
    assert segment_blocks_for(1, 368_640) == 1


def test_ticket_digest_sees_any_change():
    base = ticket_digest([4, 5, 6], [0])
    assert base == ticket_digest([4, 5, 6], (0,))
    assert base != ticket_digest([4, 5, 7], [0])
    assert base != ticket_digest([4, 5, 6], [])
    assert base != ticket_digest([4, 5, 6, 7], [0])


def test_block_runs():
    assert block_runs([3, 4, 5, 9, 1, 2, 11]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2), (6, 11, 1)]
    assert block_runs([]) == []


def test_hello_with_a_malformed_location_is_a_protocol_error():
    body = msgpack.unpackb(wire.encode(wire.Hello("p-1", "prod", KVServer("h", 1),
                                                  KVLocation("n"), LAYOUT.shape())))
    for field, bad in (("location", encode(KVServer("h", 1))),  # another message kind
                       ("server", {"host": "h", "port": 1}),  # a plain map, not a message
                       ("layout", b"\x93")):  # not msgpack
        with pytest.raises(wire.ProtocolError, match=field):
            wire.decode(msgpack.packb({**body, field: bad}))


@pytest.mark.parametrize("field", ["stall_timeout_s", "start_timeout_s", "part_bytes",
                                   "max_in_flight_parts"])
def test_config_rejects_non_positive_values(field):
    with pytest.raises(ValueError, match=field):
        TransferConfig(**{field: 0})

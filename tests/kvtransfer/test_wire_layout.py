"""Metadata on the wire (msgpack only), block layout, topology classes, configuration."""

from __future__ import annotations

import msgpack
import pytest
import torch

from kvtransfer import KVLayout, Location, TensorKVStore, TopologyClass, TransferConfig, wire
from kvtransfer.state import FailReason, Side, TransferState
from kvtransfer.transfers import block_runs, gather_blocks, scatter_blocks

torch.set_num_threads(1)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.bfloat16,
                  device=torch.device("cpu"))


@pytest.mark.parametrize("msg", [
    wire.Hello("p-1", "prod", {"host": "h", "port": 1}, {"node_id": "n"}, LAYOUT.to_wire()),
    wire.Open("r", 3),
    wire.Blocks("r", [0, 2], [5, 9], [0, 2], "bfloat16", [2, 1, 4], [1, 1], 64, [1, 2]),
    wire.Blocks("r", [1], [4], [0, 2], "bfloat16", [2, 1, 4], [1], 32, None),
    wire.End("r", TransferState.FAILED, FailReason.TIMEOUT, Side.PRODUCER, "stalled"),
    wire.End("r", TransferState.DONE),
    wire.Bye(),
])
def test_messages_round_trip(msg):
    assert wire.decode(wire.encode(msg)) == msg
    frame = torch.zeros(wire.FRAME_HEADER_BYTES + 8, dtype=torch.uint8)
    wire.write_frame_header(msg, frame)
    assert wire.read_frame_header(frame) == msg


@pytest.mark.parametrize("raw", [
    b"\xc1",  # not msgpack
    msgpack.packb([1, 2]),
    msgpack.packb({"t": "pickle", "data": b"cos\nsystem"}),
    msgpack.packb({"t": "open", "req": 1, "num_blocks": 2}),
    msgpack.packb({"t": "blocks", "req": "r", "positions": [-1], "dst": [1], "layers": [0, 1],
                   "dtype": "bfloat16", "block_shape": [1, 1, 1], "parts": [1], "nbytes": 4}),
    msgpack.packb({"t": "end", "req": "r", "state": "transferring"}),
    msgpack.packb({"t": "end", "req": "r", "state": "failed", "reason": "gremlins"}),
])
def test_malformed_messages_are_protocol_errors(raw):
    with pytest.raises(wire.ProtocolError):
        wire.decode(raw)


def test_oversized_frame_header_is_refused():
    frame = torch.zeros(wire.FRAME_HEADER_BYTES, dtype=torch.uint8)
    frame[:4] = torch.tensor(list((10**6).to_bytes(4, "little")), dtype=torch.uint8)
    with pytest.raises(wire.ProtocolError):
        wire.read_frame_header(frame)


def test_largest_blocks_header_fits_a_frame():
    n = wire.MAX_BLOCKS_PER_MESSAGE
    big = wire.Blocks("r" * 64, list(range(10**6, 10**6 + n)), list(range(2**31, 2**31 + n)),
                      [0, 80], "bfloat16", [16, 8, 128], [1] * n, 10**12, [2**32 - 1] * n)
    wire.write_frame_header(big, torch.zeros(wire.FRAME_HEADER_BYTES, dtype=torch.uint8))


def test_layout_sizes_and_wire_form():
    assert LAYOUT.bytes_per_block == 2 * 2 * 2 * 1 * 4 * 2
    assert LAYOUT.group_shape(3) == (2, 2, 3, 2, 1, 4)
    assert LAYOUT.matches_wire(msgpack.unpackb(msgpack.packb(LAYOUT.to_wire())))
    assert not LAYOUT.matches_wire({**LAYOUT.to_wire(), "dtype": "float32"})
    with pytest.raises(ValueError):
        KVLayout(0, 1, 1, 1, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError):
        KVLayout(1, 1, 1, 1, torch.complex64, torch.device("cpu"))


def test_run_copies_match_index_select():
    store = TensorKVStore(LAYOUT, 12, fill="random")
    ids = [3, 4, 5, 9, 1, 2, 11]
    assert block_runs(ids) == [(0, 3, 3), (3, 9, 1), (4, 1, 2), (6, 11, 1)]
    out = torch.empty(LAYOUT.group_shape(len(ids)), dtype=LAYOUT.dtype)
    gather_blocks(store.kv_tensor(), ids, out)
    assert torch.equal(out, store.read_blocks(ids))
    target = TensorKVStore(LAYOUT, 12)
    scatter_blocks(target.kv_tensor(), ids, out)
    assert torch.equal(target.read_blocks(ids), out)
    assert not target.read_blocks([0, 6, 7, 8, 10]).any()


def test_topology_classes():
    a = Location("n0", "cuda:0", "nvl-0")
    assert a.topology_to(Location("n0", "cuda:0", "nvl-0")) is TopologyClass.SAME_DEVICE
    assert a.topology_to(Location("n0", "cuda:1", "nvl-0")) is TopologyClass.SAME_NVLINK_DOMAIN
    assert a.topology_to(Location("n0", "cuda:1", None)) is TopologyClass.SAME_NODE
    assert a.topology_to(Location("n1", "cuda:0", "nvl-0")) is TopologyClass.CROSS_NODE
    assert Location.from_wire(msgpack.unpackb(msgpack.packb(a.to_wire()))) == a
    with pytest.raises(ValueError):
        Location.from_wire({"node_id": 1})


@pytest.mark.parametrize("field", ["stall_timeout_s", "start_timeout_s", "part_bytes"])
def test_config_rejects_non_positive_values(field):
    with pytest.raises(ValueError, match=field):
        TransferConfig(**{field: 0})

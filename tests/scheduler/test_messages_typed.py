"""Every message between processes is typed to its leaves: no field of any message class is
a map or ``Any`` (a map's keys and values are whatever the sender put there), and the
messages that used to carry maps (the KV ticket, a worker's setup) round-trip as types."""

from __future__ import annotations

import dataclasses
import types
import typing

import msgpack
import pytest

from scheduler import messages
from scheduler.messages import (
    GenerationSpec,
    HeldRequest,
    HeldStage,
    MessageError,
    SamplingSpec,
    WorkerHello,
    WorkerSetup,
    decode,
    encode,
)

MESSAGE_CLASSES = [obj for obj in vars(messages).values()
                   if isinstance(obj, type) and dataclasses.is_dataclass(obj)
                   and obj.__module__ == messages.__name__]


def _untyped(hint: object) -> bool:
    if hint is typing.Any or hint is dict:
        return True
    origin = typing.get_origin(hint)
    if origin is dict:
        return True
    if origin in (tuple, list, typing.Union, types.UnionType):
        return any(_untyped(arg) for arg in typing.get_args(hint) if arg is not Ellipsis)
    return False


def test_there_are_messages_to_check():
    assert len(MESSAGE_CLASSES) > 30 and WorkerSetup in MESSAGE_CLASSES


@pytest.mark.parametrize("cls", MESSAGE_CLASSES, ids=lambda c: c.__name__)
def test_no_message_field_is_a_map_or_any(cls):
    hints = typing.get_type_hints(cls)
    untyped = [f.name for f in dataclasses.fields(cls) if _untyped(hints[f.name])]
    assert untyped == []


SETUP = WorkerSetup(node="n0", device="cuda:1", nvlink_domain="n0/nvl-0", num_total_blocks=64,
                    num_free_blocks=60, bytes_per_block=4096, max_model_len=2048,
                    ray_node_id="abc", pid=42)


def test_a_hello_round_trips_with_its_setup():
    spec = GenerationSpec("r1", (1, 2), SamplingSpec(max_tokens=4), 0, "t", 1.0)
    hello = WorkerHello("d0", "decode", "inc-1", SETUP,
                        (HeldRequest(spec, HeldStage.DECODING, 3, 1),))
    assert decode(encode(hello), expect=WorkerHello) == hello


def test_a_hello_with_a_setup_map_is_refused():
    raw = msgpack.unpackb(encode(WorkerHello("d0", "decode", "inc-1", SETUP)))
    raw[4] = {"node": "n0", "device": "cpu"}  # what a hello used to carry
    with pytest.raises(MessageError, match="WorkerHello.info"):
        decode(msgpack.packb(raw), expect=WorkerHello)

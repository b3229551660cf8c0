"""Control messages between the two ends of a pair, as msgpack (nothing is unpickled).

Queues on the consumer's rendezvous store (see :mod:`kvtransfer.backend`)::

    accept            producer ──Hello──▶ consumer      one per new pair
    <pair>/fwd        producer ──Open | Blocks | End | Bye──▶ consumer
    <pair>/rev        consumer ──End | Bye──▶ producer

A ``Blocks`` header is followed on the pair's process group by one tensor message per part
(``parts[i]`` blocks each, shape ``[layers, 2, parts[i], *block_shape]``). Decoding checks
every field's type; anything else is a :class:`ProtocolError`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgpack

from kvtransfer.state import FailReason, Side, TransferState

MAX_MESSAGE_BYTES = 1 << 20
ACCEPT_KEY = "kvx/accept"  # the consumer's queue of Hello messages


class ProtocolError(ValueError):
    """A message that does not decode to one of the types below."""


@dataclass(frozen=True, slots=True)
class Hello:
    pair: str
    producer_id: str
    server: dict[str, Any]  # the producer's rendezvous server (its fwd queue lives there)
    location: dict[str, Any]
    layout: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Open:
    req: str
    num_blocks: int  # blocks the producer will send (prefix hits excluded)


@dataclass(frozen=True, slots=True)
class Blocks:
    req: str
    positions: list[int]  # indices into the ticket's block_ids
    dst: list[int]  # the consumer's block ids at those positions
    layers: list[int]  # [first, last + 1]
    dtype: str
    block_shape: list[int]  # [block_size, num_kv_heads, head_dim]
    parts: list[int]  # blocks per part, in order; sum == len(dst)
    nbytes: int  # whole payload
    crc: list[int] | None  # crc32 per part, or None
    # 1 per part sent "direct": a run of consecutive source blocks to a run of consecutive
    # slots, as one message per (layer, K|V) straight from pool to pool (no staging copy);
    # 0: staged, one contiguous message [layers, 2, n, *block_shape] (part 0 in the frame)
    direct: list[int] = dataclasses.field(default_factory=list)

    @property
    def part_offsets(self) -> list[int]:
        out, at = [], 0
        for n in self.parts:
            out.append(at)
            at += n
        return out


@dataclass(frozen=True, slots=True)
class End:
    """A transfer ended on the sender's side; the receiver mirrors the state."""

    req: str
    state: TransferState
    reason: FailReason | None = None
    side: Side | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Bye:
    """The sender is closing this pair (graceful teardown)."""


Message = Hello | Open | Blocks | End | Bye


def encode(msg: Message) -> bytes:
    if isinstance(msg, Hello):
        body: dict[str, Any] = {
            "t": "hello", "pair": msg.pair, "producer_id": msg.producer_id,
            "server": msg.server, "location": msg.location, "layout": msg.layout,
        }
    elif isinstance(msg, Open):
        body = {"t": "open", "req": msg.req, "num_blocks": msg.num_blocks}
    elif isinstance(msg, Blocks):
        body = {
            "t": "blocks", "req": msg.req, "positions": msg.positions, "dst": msg.dst,
            "layers": msg.layers, "dtype": msg.dtype, "block_shape": msg.block_shape,
            "parts": msg.parts, "nbytes": msg.nbytes, "crc": msg.crc, "direct": msg.direct,
        }
    elif isinstance(msg, End):
        body = {
            "t": "end", "req": msg.req, "state": msg.state.value,
            "reason": msg.reason.value if msg.reason else None,
            "side": msg.side.value if msg.side else None, "detail": msg.detail,
        }
    elif isinstance(msg, Bye):
        body = {"t": "bye"}
    else:
        raise TypeError(f"not a wire message: {msg!r}")
    return msgpack.packb(body, use_bin_type=True)


def decode(raw: bytes) -> Message:
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError("message is not bytes or is too large")
    try:
        body = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("message is not a map")
    kind = body.get("t")
    if kind == "hello":
        return Hello(
            pair=_str(body, "pair"), producer_id=_str(body, "producer_id"),
            server=_map(body, "server"), location=_map(body, "location"), layout=_map(body, "layout"),
        )
    if kind == "open":
        return Open(req=_str(body, "req"), num_blocks=_int(body, "num_blocks"))
    if kind == "blocks":
        crc = body.get("crc")
        return Blocks(
            req=_str(body, "req"), positions=_ints(body, "positions"), dst=_ints(body, "dst"),
            layers=_ints(body, "layers"), dtype=_str(body, "dtype"),
            block_shape=_ints(body, "block_shape"), parts=_ints(body, "parts"),
            nbytes=_int(body, "nbytes"), crc=None if crc is None else _ints(body, "crc"),
            direct=_ints(body, "direct"),
        )
    if kind == "end":
        try:
            state = TransferState(body.get("state"))
            reason = None if body.get("reason") is None else FailReason(body["reason"])
            side = None if body.get("side") is None else Side(body["side"])
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        if not state.is_terminal:
            raise ProtocolError(f"end message with live state {state.value}")
        return End(req=_str(body, "req"), state=state, reason=reason, side=side,
                   detail=str(body.get("detail", ""))[:500])
    if kind == "bye":
        return Bye()
    raise ProtocolError(f"unknown message type {kind!r}")


def _str(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise ProtocolError(f"field {key!r} must be a string")
    return value


def _int(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"field {key!r} must be a non-negative int")
    return value


def _ints(body: dict[str, Any], key: str) -> list[int]:
    value = body.get(key)
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ProtocolError(f"field {key!r} must be a list of non-negative ints")
    return value


def _map(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key)
    if not isinstance(value, dict):
        raise ProtocolError(f"field {key!r} must be a map")
    return value


# -- frames: a message and the first part of its payload in one tensor message --------------
# Backends whose receiver can keep a receive posted while idle (gloo, mock) carry the fwd
# messages as frames on the process group instead of the store queue: the consumer keeps a
# frame receive posted, so a one-block group costs one message. Layout (uint8):
#     [0:4] msgpack length, little endian | [4:4+len] msgpack | [FRAME_HEADER_BYTES:] part 0
FRAME_HEADER_BYTES = 16384
MAX_BLOCKS_PER_MESSAGE = 960  # keeps a Blocks header inside FRAME_HEADER_BYTES


def write_frame_header(msg: Message, frame: Any) -> None:
    """Put ``msg`` at the head of ``frame``: a writable byte view (a host slab's ``header``,
    no torch op) or a uint8 tensor of at least FRAME_HEADER_BYTES."""
    body = encode(msg)
    if len(body) + 4 > FRAME_HEADER_BYTES:
        raise ValueError(f"message of {len(body)} bytes does not fit a frame header")
    head = len(body).to_bytes(4, "little") + body
    if isinstance(frame, memoryview):
        frame[: len(head)] = head
    else:
        frame[: len(head)].copy_(_byte_tensor(head))


def read_frame_header(frame: Any) -> Message:
    """The message at the head of ``frame`` (a byte view or a uint8 tensor)."""
    if not isinstance(frame, memoryview):
        frame = memoryview(frame[:FRAME_HEADER_BYTES].cpu().numpy())
    length = int.from_bytes(frame[:4], "little")
    if length > FRAME_HEADER_BYTES - 4:
        raise ProtocolError(f"frame header length {length} out of range")
    return decode(bytes(frame[4 : 4 + length]))


def _byte_tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)

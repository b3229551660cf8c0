"""Control messages between the two ends of a pair, as msgpack (nothing is unpickled).

Where they travel::

    accept (consumer's store queue)   producer ──Hello──▶ consumer     one per new pair
    fwd (frames on the pair's group,  producer ──Open | Blocks | Keepalive | End | Bye──▶ consumer
         or the producer's store queue when the channel cannot keep a receive posted)
    rev (consumer's store queue)      consumer ──Ready | End | Bye──▶ producer

Tensor messages carry no metadata: every segment (see :mod:`kvtransfer.plan`) is one message
on the transfer's own tag, whose size and destination both sides know from the ticket. The
``Open`` carries the metadata the consumer checks against the reservation before it posts a
single receive; ``Blocks`` (announced path only) says which segments follow; ``Keepalive``
says that a transfer with nothing to send yet is alive (see :mod:`kvtransfer.transfers`).
Decoding checks every field's type; anything else is a :class:`ProtocolError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from kvtransfer.state import FailReason, Side, TransferState
from scheduler import messages
from scheduler.messages import KVLocation, KVPoolShape, KVServer

T = TypeVar("T")

MAX_MESSAGE_BYTES = 1 << 20
ACCEPT_KEY = "kvx/accept"  # the consumer's queue of Hello messages


class ProtocolError(ValueError):
    """A message that does not decode to one of the types below."""


@dataclass(frozen=True, slots=True)
class Hello:
    pair: str
    producer_id: str
    server: KVServer  # the producer's rendezvous server (its fwd queue lives there)
    location: KVLocation
    layout: KVPoolShape
    proof: str = ""  # kvtransfer.auth.pair_proof: the producer holds the ticket's secret


@dataclass(frozen=True, slots=True)
class Open:
    """The producer takes a ticket: what it will send, checked before any receive is posted."""

    req: str
    tag: int  # the ticket's tag: every segment of this transfer travels with it
    digest: int  # plan.ticket_digest of the block ids and present positions it holds
    num_blocks: int  # blocks it will send (prefix hits excluded)
    num_segments: int
    segment_blocks: int
    layers: list[int]  # [first, last + 1]
    dtype: str
    block_shape: list[int]  # [block_size, num_kv_heads, head_dim]
    posted: bool  # True: the consumer posts every receive now and answers Ready;
    # False (announced): a Blocks message precedes each batch of segments


@dataclass(frozen=True, slots=True)
class Ready:
    """Posted path: every segment's receive is posted; the producer may send."""

    req: str
    tag: int


@dataclass(frozen=True, slots=True)
class Blocks:
    """Announced path: segments ``first, first + 1, ...`` follow on ``tag``, in order (their
    sizes are given so that a consumer that does not serve the transfer can drain them)."""

    req: str
    tag: int
    first: int
    sizes: list[int]  # blocks per segment
    crc: list[int] | None  # crc32 per segment, or None


@dataclass(frozen=True, slots=True)
class Keepalive:
    """The producer's caller still holds the transfer's prefill (queued, or paused between
    chunks): nothing to send yet, and nothing is wrong. The consumer restarts the
    transfer's stall (or start) clock."""

    req: str
    tag: int


@dataclass(frozen=True, slots=True)
class End:
    """A transfer ended on the sender's side; the receiver mirrors the state. From the
    consumer, a failed or aborted End also asks the producer to release the receive the
    consumer still has posted (one empty message on the tag, see consumer_link)."""

    req: str
    state: TransferState
    reason: FailReason | None = None
    side: Side | None = None
    detail: str = ""
    tag: int = 0  # the transfer's tag: a request id may come back in a later transfer


@dataclass(frozen=True, slots=True)
class Bye:
    """The sender is closing this pair (graceful teardown)."""


Message = Hello | Open | Ready | Blocks | Keepalive | End | Bye


def encode(msg: Message) -> bytes:
    if isinstance(msg, Hello):
        body: dict[str, Any] = {
            "t": "hello", "pair": msg.pair, "producer_id": msg.producer_id,
            "server": messages.encode(msg.server), "location": messages.encode(msg.location),
            "layout": messages.encode(msg.layout),
            "proof": msg.proof,
        }
    elif isinstance(msg, Open):
        body = {
            "t": "open", "req": msg.req, "tag": msg.tag, "digest": msg.digest,
            "num_blocks": msg.num_blocks, "num_segments": msg.num_segments,
            "segment_blocks": msg.segment_blocks, "layers": msg.layers, "dtype": msg.dtype,
            "block_shape": msg.block_shape, "posted": msg.posted,
        }
    elif isinstance(msg, Ready):
        body = {"t": "ready", "req": msg.req, "tag": msg.tag}
    elif isinstance(msg, Blocks):
        body = {"t": "blocks", "req": msg.req, "tag": msg.tag, "first": msg.first,
                "sizes": msg.sizes, "crc": msg.crc}
    elif isinstance(msg, Keepalive):
        body = {"t": "keepalive", "req": msg.req, "tag": msg.tag}
    elif isinstance(msg, End):
        body = {
            "t": "end", "req": msg.req, "state": msg.state.value,
            "reason": msg.reason.value if msg.reason else None,
            "side": msg.side.value if msg.side else None, "detail": msg.detail,
            "tag": msg.tag,
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
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("message is not a map")
    kind = body.get("t")
    if kind == "hello":
        return Hello(
            pair=_str(body, "pair"), producer_id=_str(body, "producer_id"),
            server=_typed(body, "server", KVServer), location=_typed(body, "location", KVLocation),
            layout=_typed(body, "layout", KVPoolShape),
            proof=_str(body, "proof"),
        )
    if kind == "open":
        posted = body.get("posted")
        if not isinstance(posted, bool):
            raise ProtocolError("field 'posted' must be a bool")
        return Open(
            req=_str(body, "req"), tag=_int(body, "tag"), digest=_int(body, "digest"),
            num_blocks=_int(body, "num_blocks"), num_segments=_int(body, "num_segments"),
            segment_blocks=_int(body, "segment_blocks"), layers=_ints(body, "layers"),
            dtype=_str(body, "dtype"), block_shape=_ints(body, "block_shape"), posted=posted,
        )
    if kind == "ready":
        return Ready(req=_str(body, "req"), tag=_int(body, "tag"))
    if kind == "blocks":
        crc = body.get("crc")
        return Blocks(req=_str(body, "req"), tag=_int(body, "tag"), first=_int(body, "first"),
                      sizes=_ints(body, "sizes"), crc=None if crc is None else _ints(body, "crc"))
    if kind == "keepalive":
        return Keepalive(req=_str(body, "req"), tag=_int(body, "tag"))
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
                   detail=str(body.get("detail", ""))[:500], tag=_int(body, "tag"))
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


def _typed(body: dict[str, Any], key: str, cls: type[T]) -> T:
    """A field that is one of the scheduler's typed messages (``scheduler.messages``)."""
    value = body.get(key)
    if not isinstance(value, bytes):
        raise ProtocolError(f"field {key!r} must be an encoded {cls.__name__}")
    try:
        return messages.decode(value, expect=cls)
    except ValueError as exc:  # MessageError, or the message's own check
        raise ProtocolError(f"field {key!r}: {exc}") from None


# -- frames: fwd messages as tensor messages on the pair's group ------------------------------
# Channels whose receiver can keep a receive posted while idle (gloo, mock) carry the fwd
# messages as frames on FRAME_TAG: the consumer keeps one frame receive posted, so a message
# costs one tensor message and no store round trip. Layout (uint8, FRAME_BYTES):
#     [0:4] msgpack length, little endian | [4:4+len] msgpack
FRAME_BYTES = 8192
MAX_SEGMENTS_PER_BLOCKS = 512  # keeps a Blocks message with checksums inside a frame


def write_frame(msg: Message, frame: memoryview) -> None:
    """Put ``msg`` into ``frame``, a writable byte view of a FRAME_BYTES buffer."""
    body = encode(msg)
    if len(body) + 4 > FRAME_BYTES:
        raise ValueError(f"message of {len(body)} bytes does not fit a frame")
    frame[: 4 + len(body)] = len(body).to_bytes(4, "little") + body


def read_frame(frame: memoryview) -> Message:
    """The message in ``frame`` (a byte view of a received FRAME_BYTES buffer)."""
    length = int.from_bytes(frame[:4], "little")
    if length > FRAME_BYTES - 4:
        raise ProtocolError(f"frame length {length} out of range")
    return decode(bytes(frame[4 : 4 + length]))

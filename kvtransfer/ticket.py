"""The producer's check of a consumer's ticket (``scheduler.messages.KVTicket``).

A ticket reaches ``KVProducer.begin`` from another process (a ``StartPrefill`` or a
``MigrateAnswer``): the message codec has checked its field types once, but not what the
producer relies on, so every field is checked again here (types too, since a caller in this
process may build one by hand), lengths and ranges included. Anything off is a
``ValueError`` that names the field.
"""

from __future__ import annotations

from kvtransfer.backend import FIRST_DATA_TAG, MAX_DATA_TAG
from kvtransfer.layout import WIRE_DTYPES
from scheduler.messages import KVEndpoint, KVLocation, KVPoolShape, KVServer, KVTicket

MAX_ID_CHARS = 256  # request and endpoint ids, hosts, backend names, secrets
MAX_TICKET_BLOCKS = 1 << 20  # more slots than any pool holds
MAX_BLOCK_ID = (1 << 31) - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_str(value: object, what: str, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise ValueError(f"ticket {what} must be a non-empty string of at most "
                         f"{MAX_ID_CHARS} characters, got {value!r:.80}")


def _check_int(value: object, what: str, low: int, high: int) -> None:
    if not _is_int(value) or not low <= value <= high:  # type: ignore[operator]
        raise ValueError(f"ticket {what} must be an int in [{low}, {high}], got {value!r:.80}")


def _check_ints(values: object, what: str, *, low: int, high: int,
                non_empty: bool) -> tuple[int, ...]:
    if not isinstance(values, (tuple, list)):
        raise ValueError(f"ticket {what} must be a sequence of ints, got "
                         f"{type(values).__name__}")
    if len(values) > MAX_TICKET_BLOCKS or (non_empty and not values):
        raise ValueError(f"ticket {what} must hold {'1' if non_empty else '0'} to "
                         f"{MAX_TICKET_BLOCKS} items, got {len(values)}")
    if not all(_is_int(v) and low <= v <= high for v in values):
        raise ValueError(f"ticket {what} must be ints in [{low}, {high}]")
    if len(set(values)) != len(values):
        raise ValueError(f"ticket {what} must be distinct")
    return tuple(values)


def _check_endpoint(consumer: object) -> KVEndpoint:
    if not isinstance(consumer, KVEndpoint):
        raise ValueError(f"ticket consumer must be a KVEndpoint, got {type(consumer).__name__}")
    _check_str(consumer.endpoint_id, "consumer.endpoint_id")
    _check_str(consumer.backend, "consumer.backend")
    server = consumer.server
    if not isinstance(server, KVServer):
        raise ValueError(f"ticket consumer.server must be a KVServer, got "
                         f"{type(server).__name__}")
    _check_str(server.host, "consumer.server.host")
    _check_int(server.port, "consumer.server.port", 0, 65535)
    loc = consumer.location
    if not isinstance(loc, KVLocation):
        raise ValueError(f"ticket consumer.location must be a KVLocation, got "
                         f"{type(loc).__name__}")
    for name in ("node_id", "device", "host"):
        _check_str(getattr(loc, name), f"consumer.location.{name}")
    _check_str(loc.nvlink_domain, "consumer.location.nvlink_domain", optional=True)
    shape = consumer.layout
    if not isinstance(shape, KVPoolShape):
        raise ValueError(f"ticket consumer.layout must be a KVPoolShape, got "
                         f"{type(shape).__name__}")
    for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
        _check_int(getattr(shape, name), f"consumer.layout.{name}", 1, 1 << 20)
    if shape.dtype not in WIRE_DTYPES:
        raise ValueError(f"ticket consumer.layout.dtype {shape.dtype!r:.40} is not one of "
                         f"{sorted(WIRE_DTYPES)}")
    return consumer


def check_ticket(ticket: object) -> KVTicket:
    """``ticket`` if it is a well-formed KVTicket; else a ValueError that names the field."""
    if not isinstance(ticket, KVTicket):
        raise ValueError(f"ticket must be a KVTicket, got {type(ticket).__name__}")
    _check_str(ticket.req_id, "req_id")
    block_ids = _check_ints(ticket.block_ids, "block_ids", low=0, high=MAX_BLOCK_ID,
                            non_empty=True)
    _check_ints(ticket.present, "present", low=0, high=len(block_ids) - 1, non_empty=False)
    _check_int(ticket.tag, "tag", FIRST_DATA_TAG, MAX_DATA_TAG)
    _check_int(ticket.segment_blocks, "segment_blocks", 1, MAX_TICKET_BLOCKS)
    _check_endpoint(ticket.consumer)
    if not isinstance(ticket.secret, str) or not ticket.secret:
        raise ValueError("ticket carries no secret (a ticket from KVConsumer.expect has one)")
    _check_str(ticket.secret, "secret")
    return ticket

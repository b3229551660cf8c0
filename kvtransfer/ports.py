"""The KV plane as the worker pools drive it: :class:`KVReceiver` (a decode worker's
consumer) and :class:`KVSender` (a prefill worker's, or a migrating decode worker's,
producer). Protocols, so a pool's unit test can stand a fake in and the type checker
holds the pool to the calls :class:`~kvtransfer.consumer.KVConsumer` and
:class:`~kvtransfer.producer.KVProducer` answer. Every call here returns at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvtransfer.guard import ListenerStats
from kvtransfer.state import TransferState, TransferStats, TransferStatus
from scheduler.messages import TransferStat


class _Transfers(Protocol):
    def poll(self, req_id: str) -> TransferStatus | None: ...

    def abort(self, req_id: str) -> bool: ...

    def forget(self, req_id: str) -> TransferStatus | None: ...

    def drain_stats(self) -> list[TransferStats]: ...


class KVReceiver(_Transfers, Protocol):
    def expect(self, req_id: str, block_ids: Sequence[int], present: Sequence[int] = ()
               ) -> Any: ...  # the ticket the sender needs

    def is_healthy(self) -> bool: ...  # False: no new pair can open here (kvtransfer.guard)

    def listener_stats(self) -> ListenerStats: ...


class KVSender(_Transfers, Protocol):
    def begin(self, ticket: Any) -> None: ...

    def push(self, req_id: str, src_block_ids: Sequence[int],
             first_position: int | None = None) -> None: ...

    def keepalive(self, req_id: str) -> bool: ...


def arrived(status: TransferStatus | None) -> bool | None:
    """A transfer's status as a worker core reads it: in flight or unknown (None), all
    there (True), or failed, aborted or lost (False)."""
    if status is None or not status.state.is_terminal:
        return None
    return status.state is TransferState.DONE


def done_transfers(side: _Transfers) -> list[TransferStat]:
    """The transfers that completed since the last call, as the scheduler's link model
    takes them (failed ones teach no link speed)."""
    return [TransferStat(s.req_id, s.num_bytes, s.duration_s, s.end_time, s.topology)
            for s in side.drain_stats() if s.state is TransferState.DONE]

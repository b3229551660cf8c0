"""What the transfer protocol needs from a transport, as three small interfaces.

* :class:`MessageQueue` -- named FIFO queues of msgpack bytes on an endpoint's rendezvous
  server. Each endpoint hosts one server; a thread that blocks on ``pop`` holds its own
  client connection. Queues are read from the *peer's* server, so a peer that dies turns a
  blocked ``pop`` into a :class:`ChannelError` at once; a local close wakes its own readers
  by pushing a ``Bye`` into the queue they wait on.
* :class:`Channel` -- a two-rank tensor pipe (rank 0 = producer, rank 1 = consumer) with
  asynchronous ``send``/``recv`` whose ``wait(timeout_s)`` raises :class:`ChannelError`.
  Messages on one tag are matched to receives on that tag in posting order; a receive may be
  larger than its message (``can_prepost`` channels) and a message may be empty. A receive
  must get its message before its :class:`Work` is dropped: over gloo a message that comes
  for a dropped receive wedges the pair. A wait that times out may break the whole channel
  (gloo closes the pair), so an idle wait is long and a short one means the pair is given up.
* :class:`Backend` -- builds both from an endpoint's server address
  (``scheduler.messages.KVServer``, a typed message: it travels in tickets and hellos).

Implementations: :class:`kvtransfer.dist_backend.DistBackend` (TCPStore + ProcessGroupGloo /
ProcessGroupNCCL) and :class:`kvtransfer.mock_backend.MockBackend` (in-process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kvtransfer.guard import RefusalCounts
from scheduler.messages import KVServer

FRAME_TAG = 2  # fwd messages as frames (channels with can_prepost)
CLOSE_TAG = 3  # a receive nobody sends to: DistChannel.close times out on it
FIRST_DATA_TAG = 16  # transfers get their own tags from here (the consumer hands them out)
MAX_DATA_TAG = (1 << 31) - 1


class ChannelError(Exception):
    """A send, receive or queue operation that cannot complete."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class Work(Protocol):
    def wait(self, timeout_s: float) -> None:
        """Block until the operation completed; ChannelError on timeout or a broken pipe."""
        ...


class Channel(Protocol):
    backend_name: str
    # True when a receive may stay posted while idle and may be larger than the message
    # (gloo, mock): fwd messages then travel as frames on the channel itself. False for
    # NCCL (a posted receive occupies the GPU): they travel through the store queue.
    can_prepost: bool

    def send(self, tensor: torch.Tensor, tag: int) -> Work: ...

    def recv(self, tensor: torch.Tensor, tag: int) -> Work: ...

    def close(self) -> None:
        """Tear the pipe down: every pending operation on both ends fails (their waits raise)
        and so do later ones."""
        ...


class MessageQueue(Protocol):
    def push(self, key: str, data: bytes) -> None: ...

    def pop(self, key: str) -> bytes:
        """Block until a message arrives; ChannelError when the server is gone."""
        ...

    def pending(self, key: str) -> int:
        """How many messages wait in ``key`` (a bound is checked before a pop)."""
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str  # "dist" | "mock"

    def listen(self, host: str) -> KVServer:
        """Start this endpoint's rendezvous server; returns its address."""
        ...

    def open_queue(self, address: KVServer, timeout_s: float) -> MessageQueue:
        """A new client connection to the server at ``address``."""
        ...

    def channel_backend_name(self, device: torch.device) -> str: ...

    def open_channel(
        self,
        address: KVServer,
        pair: str,
        rank: int,
        device: torch.device,
        local_host: str,
        timeout_s: float,
        on_connected: Callable[[], None] | None = None,
        *,
        secret: str,
        counts: RefusalCounts | None = None,
    ) -> Channel:
        """Rendezvous with the other rank of ``pair`` at ``address`` (blocking).

        ``on_connected`` runs once this side's connection to the rendezvous server is up and
        before it waits for the peer: the producer announces the pair from there, so the two
        sides never connect to the server at the same moment. ``secret`` (the consumer's)
        seals what the rendezvous stores and checks what it reads; a value that fails is
        counted in ``counts`` and fails the rendezvous."""
        ...

    def shutdown(self) -> None:
        """Stop this endpoint's server."""
        ...

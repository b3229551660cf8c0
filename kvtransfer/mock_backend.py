"""In-process transport with the :class:`kvtransfer.backend.Backend` interface.

For unit tests of the layers above (worker actors, schedulers): producers and consumers in one
process talk through a :class:`MockHub` (queues and tensor pipes in memory) with the same
protocol, states, timeouts and failure handling as the torch.distributed transport. A send
copies into the receive posted for it (or into an inbox until one is), so the two pools never
alias; receives are matched per tag in posting order and may be larger than their message; a
timed-out wait closes the pipe and a message for a dropped receive breaks it, as over gloo.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from kvtransfer.backend import ChannelError
from kvtransfer.guard import RefusalCounts
from scheduler.messages import KVServer

_hubs: dict[str, MockHub] = {}
_hubs_lock = threading.Lock()


class MockHub:
    """A namespace of in-memory servers and pipes; endpoints on one hub can reach each other."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"hub-{id(self):x}"
        self._lock = threading.Condition()
        self._servers: dict[int, dict[str, deque[bytes]]] = {}
        self._pipes: dict[str, _MockPipe] = {}
        self._ids = itertools.count(1)
        with _hubs_lock:
            _hubs[self.name] = self

    @classmethod
    def lookup(cls, name: str) -> MockHub:
        with _hubs_lock:
            hub = _hubs.get(name)
        if hub is None:
            raise ChannelError(f"no mock hub named {name!r}")
        return hub

    def add_server(self) -> int:
        with self._lock:
            server = next(self._ids)
            self._servers[server] = {}
            return server

    def remove_server(self, server: int) -> None:
        with self._lock:
            self._servers.pop(server, None)
            self._lock.notify_all()

    def push(self, server: int, key: str, data: bytes) -> None:
        with self._lock:
            queues = self._servers.get(server)
            if queues is None:
                raise ChannelError(f"mock server {server} is gone")
            queues.setdefault(key, deque()).append(bytes(data))
            self._lock.notify_all()

    def pop(self, server: int, key: str) -> bytes:
        with self._lock:
            while True:
                queues = self._servers.get(server)
                if queues is None:
                    raise ChannelError(f"mock server {server} is gone")
                queue = queues.get(key)
                if queue:
                    return queue.popleft()
                self._lock.wait()

    def pending(self, server: int, key: str) -> int:
        with self._lock:
            queues = self._servers.get(server)
            if queues is None:
                raise ChannelError(f"mock server {server} is gone")
            return len(queues.get(key, ()))

    def pipe(self, pair: str, timeout_s: float) -> _MockPipe:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            pipe = self._pipes.get(pair)
            if pipe is None:
                pipe = self._pipes[pair] = _MockPipe()
                while pipe.arrivals < 1:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        del self._pipes[pair]
                        raise ChannelError(f"mock rendezvous for {pair} timed out", timed_out=True)
                    self._lock.wait(remaining)
            else:
                pipe.arrivals += 1
                del self._pipes[pair]
                self._lock.notify_all()
            return pipe


class _MockPipe:
    """Two directions of tensor messages, matched per (destination rank, tag) in order."""

    def __init__(self) -> None:
        self.arrivals = 0
        self.cond = threading.Condition()
        self.posted: dict[tuple[int, int], deque[_Slot]] = {}  # receives waiting for a message
        self.inbox: dict[tuple[int, int], deque[torch.Tensor]] = {}  # messages before a receive
        self.closed = False


class _Slot:
    """A posted receive as the pipe sees it (the Work handed out refers to it)."""

    __slots__ = ("buffer", "done", "error", "cancelled")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.done = False
        self.error: str | None = None
        self.cancelled = False

    def fill(self, data: torch.Tensor) -> None:
        src = data.reshape(-1).view(torch.uint8)
        dst = self.buffer.reshape(-1).view(torch.uint8)
        if src.numel() > dst.numel():
            self.error = "recv: message larger than the posted buffer"
        else:
            dst[: src.numel()].copy_(src)
        self.done = True


class _MockSendWork:
    __slots__ = ()

    def wait(self, timeout_s: float) -> None:  # a send is buffered at once
        return None


class _MockRecvWork:
    """Like gloo's: a wait that times out closes the pipe, and a receive dropped before its
    message comes breaks the pipe when the message does (gloo wedges the pair then)."""

    __slots__ = ("_pipe", "_slot")

    def __init__(self, pipe: _MockPipe, slot: _Slot) -> None:
        self._pipe, self._slot = pipe, slot

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pipe, slot = self._pipe, self._slot
        with pipe.cond:
            while not slot.done:
                if pipe.closed:
                    raise ChannelError("recv: mock pipe closed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    pipe.closed = True  # as gloo closes the pair on an application timeout
                    pipe.cond.notify_all()
                    raise ChannelError("recv: timed out", timed_out=True)
                pipe.cond.wait(remaining)
        if slot.error is not None:
            raise ChannelError(slot.error)

    def __del__(self) -> None:
        try:
            with self._pipe.cond:
                self._slot.cancelled = True
        except Exception:  # interpreter shutdown
            pass


class MockChannel:
    backend_name = "mock"
    can_prepost = True

    def __init__(self, pipe: _MockPipe, rank: int) -> None:
        self._pipe, self._rank = pipe, rank

    def send(self, tensor: torch.Tensor, tag: int) -> _MockSendWork:
        pipe = self._pipe
        with pipe.cond:
            if pipe.closed:
                raise ChannelError("send: mock pipe closed")
            key = (1 - self._rank, tag)
            posted = pipe.posted.get(key)
            if posted:
                slot = posted.popleft()
                if slot.cancelled:
                    # gloo wedges the pair when a message comes for a dropped receive (it can
                    # neither deliver nor skip it): the mock breaks the pipe so tests see it
                    pipe.closed = True
                    pipe.cond.notify_all()
                    raise ChannelError("send: message for a cancelled receive (the pair "
                                       "would be wedged)")
                slot.fill(tensor)
                pipe.cond.notify_all()
            else:
                pipe.inbox.setdefault(key, deque()).append(tensor.detach().clone())
        return _MockSendWork()

    def recv(self, tensor: torch.Tensor, tag: int) -> _MockRecvWork:
        pipe = self._pipe
        slot = _Slot(tensor)
        with pipe.cond:
            if pipe.closed:
                raise ChannelError("recv: mock pipe closed")
            key = (self._rank, tag)
            inbox = pipe.inbox.get(key)
            if inbox:
                slot.fill(inbox.popleft())
            else:
                pipe.posted.setdefault(key, deque()).append(slot)
        return _MockRecvWork(pipe, slot)

    def close(self) -> None:
        with self._pipe.cond:
            self._pipe.closed = True
            self._pipe.cond.notify_all()


class _MockQueue:
    def __init__(self, hub: MockHub, server: int) -> None:
        self._hub, self._server = hub, server

    def push(self, key: str, data: bytes) -> None:
        self._hub.push(self._server, key, data)

    def pop(self, key: str) -> bytes:
        return self._hub.pop(self._server, key)

    def pending(self, key: str) -> int:
        return self._hub.pending(self._server, key)

    def close(self) -> None:
        return None


class MockBackend:
    """One endpoint on a :class:`MockHub` (the process-wide default hub when none is given)."""

    name = "mock"

    def __init__(self, hub: MockHub | None = None) -> None:
        self._hub = hub or _default_hub()
        self._server: int | None = None

    def listen(self, host: str) -> KVServer:
        if self._server is not None:
            raise RuntimeError("MockBackend.listen called twice; use one backend per endpoint")
        self._server = self._hub.add_server()
        return KVServer(host=self._hub.name, port=self._server)  # the hub stands for a host

    def open_queue(self, address: KVServer, timeout_s: float) -> _MockQueue:
        return _MockQueue(MockHub.lookup(address.host), address.port)

    def channel_backend_name(self, device: torch.device) -> str:
        return "mock"

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
    ) -> MockChannel:
        """In-process: no store values to seal (``secret`` and ``counts`` go unused)."""
        hub = MockHub.lookup(address.host)
        if on_connected is not None:
            on_connected()
        return MockChannel(hub.pipe(pair, timeout_s), rank)

    def shutdown(self) -> None:
        """Like a process exit: queues on this endpoint's server fail for their readers."""
        if self._server is not None:
            self._hub.remove_server(self._server)
            self._server = None


def _default_hub() -> MockHub:
    with _hubs_lock:
        hub = _hubs.get("default")
    return hub or MockHub("default")

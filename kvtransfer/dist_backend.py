"""torch.distributed transport: one TCPStore per endpoint, one process group per pair.

No global world group and no ``init_process_group``: every pair builds its own two-rank
``ProcessGroupGloo`` (CPU tensors) or ``ProcessGroupNCCL`` (CUDA tensors) from a
``PrefixStore`` on the consumer's TCPStore, so a worker holds groups to many peers at once
and tearing one down (``abort``) leaves the others alone.

A TCPStore server left to itself listens on every interface; ours gets a socket already
bound to the address the endpoint advertises (the node address the cluster uses), so it
is not reachable on any other interface. Gloo's own listener binds that address too.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer.backend import CLOSE_TAG, ChannelError
from scheduler.messages import KVServer

# Blocking pops wake up this often only to re-arm; closing wakes them with a message.
_POP_REARM = datetime.timedelta(hours=1)
# Ops always wait with an explicit timeout; the group's own default only bounds rendezvous.
_GROUP_TIMEOUT = datetime.timedelta(days=7)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class _DistWork:
    __slots__ = ("_work", "_what", "_cuda")

    def __init__(self, work: Any, what: str, cuda: bool) -> None:
        self._work, self._what, self._cuda = work, what, cuda

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait(_td(timeout_s))
        except RuntimeError as exc:
            text = str(exc)
            raise ChannelError(
                f"{self._what}: {text.splitlines()[0][:300]}",
                timed_out="Timed out" in text or "timeout" in text.lower(),
            ) from None


class DistChannel:
    def __init__(self, group: Any, rank: int, backend_name: str, can_prepost: bool) -> None:
        self._group, self._peer = group, 1 - rank
        self.backend_name = backend_name
        self.can_prepost = can_prepost
        self._cuda = backend_name == "nccl"
        self._closed = False

    def send(self, tensor: torch.Tensor, tag: int) -> _DistWork:
        try:
            return _DistWork(self._group.send([tensor], self._peer, tag), f"send (tag {tag})",
                             self._cuda)
        except RuntimeError as exc:
            raise ChannelError(f"send: {str(exc).splitlines()[0][:300]}") from None

    def recv(self, tensor: torch.Tensor, tag: int) -> _DistWork:
        try:
            return _DistWork(self._group.recv([tensor], self._peer, tag), f"recv (tag {tag})",
                             self._cuda)
        except RuntimeError as exc:
            raise ChannelError(f"recv: {str(exc).splitlines()[0][:300]}") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._cuda:
            try:
                self._group.abort()  # aborts the NCCL communicator
            except RuntimeError:
                self._group.shutdown()
            return
        # ProcessGroupGloo's abort() and shutdown() leave the pair open (measured: a receive
        # posted before either still gets the peer's next message). What does close it is an
        # application timeout: gloo then signals every pair of the group, each pending and
        # later operation on both ends fails. So time out on a receive nobody sends to.
        try:
            work = self._group.recv([torch.empty(1, dtype=torch.uint8)], self._peer, CLOSE_TAG)
            work.wait(datetime.timedelta(milliseconds=1))
        except RuntimeError:
            pass


class DistQueue:
    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        try:
            self._store = dist.TCPStore(host, port, is_master=False, timeout=_td(timeout_s))
        except (RuntimeError, dist.DistError) as exc:
            raise ChannelError(f"cannot reach {host}:{port}: {exc}") from None
        self._store.set_timeout(_POP_REARM)

    def push(self, key: str, data: bytes) -> None:
        try:
            self._store.queue_push(key, data)
        except (RuntimeError, dist.DistError) as exc:
            raise ChannelError(f"queue push {key}: {str(exc).splitlines()[0]}") from None

    def pop(self, key: str) -> bytes:
        while True:
            try:
                return self._store.queue_pop(key, block=True)
            except dist.DistStoreError as exc:
                if "timeout" in str(exc).lower():
                    continue
                raise ChannelError(f"queue pop {key}: {str(exc).splitlines()[0]}") from None
            except (RuntimeError, dist.DistError) as exc:
                raise ChannelError(f"queue pop {key}: {str(exc).splitlines()[0]}") from None

    def close(self) -> None:
        self._store = None


def _bound_listener(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` (not the wildcard address), any free port."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


class DistBackend:
    """TCPStore rendezvous; gloo for CPU pools, NCCL for CUDA pools (chosen per device)."""

    name = "dist"

    def __init__(self, *, frames: bool | None = None) -> None:
        """``frames``: carry fwd messages as frames on the group (default: gloo yes, NCCL no;
        False on gloo exercises the store-queue path NCCL uses). Both ends must agree."""
        self._server: dist.TCPStore | None = None
        self._frames = frames

    def listen(self, host: str) -> KVServer:
        if self._server is not None:
            raise RuntimeError("DistBackend.listen called twice; use one backend per endpoint")
        listener = _bound_listener(host)
        port = int(listener.getsockname()[1])
        # The store owns the socket from here (its fd), so the Python object lets go of it.
        self._server = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=_td(60),
            use_libuv=True, master_listen_fd=listener.detach(),
        )
        return KVServer(host=host, port=port)

    def open_queue(self, address: KVServer, timeout_s: float) -> DistQueue:
        return DistQueue(address.host, address.port, timeout_s)

    def channel_backend_name(self, device: torch.device) -> str:
        return "nccl" if device.type == "cuda" else "gloo"

    def open_channel(
        self,
        address: KVServer,
        pair: str,
        rank: int,
        device: torch.device,
        local_host: str,
        timeout_s: float,
        on_connected: Callable[[], None] | None = None,
    ) -> DistChannel:
        kind = self.channel_backend_name(device)
        try:
            client = dist.TCPStore(
                address.host, address.port, is_master=False, timeout=_td(timeout_s)
            )
            if on_connected is not None:
                on_connected()
            store = dist.PrefixStore(f"kvx/pg/{pair}", client)
            if kind == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = _td(timeout_s)
                group = dist.ProcessGroupNCCL(store, rank, 2, opts)
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
                opts._timeout = _GROUP_TIMEOUT
                group = dist.ProcessGroupGloo(store, rank, 2, opts)
        except (RuntimeError, dist.DistError) as exc:
            raise ChannelError(f"rendezvous for pair {pair} failed: {exc}") from None
        frames = (kind == "gloo") if self._frames is None else (self._frames and kind == "gloo")
        return DistChannel(group, rank, kind, frames)

    def shutdown(self) -> None:
        self._server = None

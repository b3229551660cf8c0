"""torch.distributed transport: one TCPStore per endpoint, one process group per pair.

No global world group and no ``init_process_group``: every pair builds its own two-rank
``ProcessGroupGloo`` (CPU tensors) or ``ProcessGroupNCCL`` (CUDA tensors) from a
``PrefixStore`` on the consumer's TCPStore, so a worker holds groups to many peers at once
and tearing one down (``abort``) leaves the others alone.

A TCPStore server left to itself listens on every interface; ours gets a socket already
bound to the address the endpoint advertises (the node address the cluster uses), so it
is not reachable on any other interface. Gloo's own listener binds that address too.

The store has no authentication of its own, so the pair's group meets through a
:class:`SealedStore`: every value gloo or NCCL sets there is sealed with the consumer's
secret over its full key (``kvx/pg/{pair}/...``), every value read is checked
(``kvtransfer.auth.open_value``). An overwritten, moved or forged value fails the group's
rendezvous (a ChannelError, counted) instead of connecting to whoever wrote it. The libuv
server refuses any single value over 8 MiB before storing it (and drops that connection);
queue messages are bounded again on read (``DistQueue.pop``'s caller, ``auth.unseal``).
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer import auth
from kvtransfer.backend import CLOSE_TAG, ChannelError
from kvtransfer.guard import Refusal, RefusalCounts
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


class SealedStore(dist.Store):
    """A pair's view of the consumer's store for its group's rendezvous: values sealed on
    ``set``, checked on ``get`` (a refused one raises, so the rendezvous fails, and is
    counted in ``counts``). Integer counters (``add``) cannot be sealed and pass through;
    gloo and NCCL meet with ``set``/``wait``/``get`` only. The caller keeps this object
    referenced while the group lives: C++ holds only its native half."""

    def __init__(self, inner: Any, secret: str, counts: RefusalCounts | None = None) -> None:
        super().__init__()
        self._inner, self._secret, self._counts = inner, secret, counts
        self._clones: list[SealedStore] = []

    def _open(self, key: str, raw: bytes) -> bytes:
        try:
            return auth.open_value(self._secret, key, raw)
        except auth.AuthError as exc:
            if self._counts is not None:
                self._counts.count(Refusal(exc.kind))
            raise RuntimeError(f"store value {key} refused: {exc}") from None

    def set(self, key: str, value: bytes) -> None:
        self._inner.set(key, auth.seal_value(self._secret, key, bytes(value)))

    def get(self, key: str) -> bytes:
        return self._open(key, self._inner.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._open(k, v) for k, v in zip(keys, self._inner.multi_get(keys), strict=True)]

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._inner.multi_set(keys, [auth.seal_value(self._secret, k, bytes(v))
                                     for k, v in zip(keys, values, strict=True)])

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        raise RuntimeError("compare_set on a sealed store is not supported")

    def append(self, key: str, value: bytes) -> None:
        raise RuntimeError("append on a sealed store is not supported")

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    def has_extended_api(self) -> bool:
        return False

    def clone(self) -> SealedStore:
        twin = SealedStore(self._inner.clone(), self._secret, self._counts)
        self._clones.append(twin)
        return twin


class DistChannel:
    def __init__(self, group: Any, rank: int, backend_name: str, can_prepost: bool,
                 stores: tuple[Any, ...] = ()) -> None:
        self._group, self._peer = group, 1 - rank
        self._stores = stores  # the group's rendezvous stores, kept alive with it
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

    def pending(self, key: str) -> int:
        try:
            return int(self._store.queue_len(key))
        except (RuntimeError, dist.DistError) as exc:
            raise ChannelError(f"queue length {key}: {str(exc).splitlines()[0]}") from None

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
        *,
        secret: str,
        counts: RefusalCounts | None = None,
    ) -> DistChannel:
        kind = self.channel_backend_name(device)
        try:
            client = dist.TCPStore(
                address.host, address.port, is_master=False, timeout=_td(timeout_s)
            )
            if on_connected is not None:
                on_connected()
            sealed = SealedStore(client, secret, counts)
            store = dist.PrefixStore(f"kvx/pg/{pair}", sealed)
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
        return DistChannel(group, rank, kind, frames, (sealed, store))

    def shutdown(self) -> None:
        self._server = None

"""Helpers for tests of kvtransfer and of the layers above: a peer in another process.

:class:`PeerProcess` spawns (multiprocessing, spawn context) a process that hosts a
:class:`~kvtransfer.KVConsumer` or :class:`~kvtransfer.KVProducer` over a
:class:`~kvtransfer.TensorKVStore` and obeys msgpack commands sent through a pipe (nothing is
pickled but the spawn arguments, which are plain values). The peer can be frozen
(``SIGSTOP``) or killed to test stalls and peer loss.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import msgpack
import torch

from kvtransfer.consumer import KVConsumer
from kvtransfer.dist_backend import DistBackend
from kvtransfer.layout import KVLayout, TensorKVStore, dtype_from_wire
from kvtransfer.producer import KVProducer
from kvtransfer.state import KVLocation, TransferConfig, TransferStatus
from scheduler.messages import KVEndpoint, KVTicket, decode, encode


def make_layout(spec: dict[str, Any]) -> KVLayout:
    return KVLayout(
        num_layers=spec["num_layers"], num_kv_heads=spec["num_kv_heads"],
        head_dim=spec["head_dim"], block_size=spec["block_size"],
        dtype=dtype_from_wire(spec["dtype"]), device=torch.device(spec.get("device", "cpu")),
    )


def seeded_store(layout: KVLayout, num_blocks: int, seed: int | None, *,
                 layer_major: bool = False) -> TensorKVStore:
    """A pool (block-major, or layer-major) that is zeros (seed None) or a reproducible random
    fill."""
    store = TensorKVStore(layout, num_blocks, layer_major=layer_major)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        data = torch.randn(store.kv_tensor().shape, generator=gen).to(layout.dtype)
        store.kv_tensor().copy_(data)
    return store


def status_to_wire(status: TransferStatus | None) -> dict[str, Any] | None:
    if status is None:
        return None
    return {
        "state": status.state.value,
        "reason": status.reason.value if status.reason else None,
        "side": status.failed_side.value if status.failed_side else None,
        "detail": status.detail,
        "done": status.num_blocks_done,
        "total": status.num_blocks_total,
    }


def wait_terminal(endpoint: KVConsumer | KVProducer, req_id: str, timeout_s: float) -> TransferStatus | None:
    """Poll until the transfer is terminal (or ``timeout_s`` passed); returns the last status."""
    deadline = time.monotonic() + timeout_s
    status = endpoint.poll(req_id)
    while (status is None or not status.state.is_terminal) and time.monotonic() < deadline:
        time.sleep(0.005)
        status = endpoint.poll(req_id)
    return status


def _peer_main(conn: Any, role: str, layout_spec: dict[str, Any], num_blocks: int,
               seed: int | None, config: dict[str, Any], node_id: str,
               frames: bool | None, layer_major: bool) -> None:
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack
    layout = make_layout(layout_spec)
    store = seeded_store(layout, num_blocks, seed, layer_major=layer_major)
    cls = KVConsumer if role == "consumer" else KVProducer
    endpoint = cls(store, location=KVLocation(node_id, str(layout.device)),
                   config=TransferConfig(**config), backend=DistBackend(frames=frames))
    conn.send_bytes(msgpack.packb({"address": encode(endpoint.address())}))
    while True:
        cmd = msgpack.unpackb(conn.recv_bytes())
        op = cmd["op"]
        reply: dict[str, Any] = {}
        try:
            if op == "expect":
                reply["ticket"] = encode(
                    endpoint.expect(cmd["req_id"], cmd["block_ids"], cmd.get("present", [])))
            elif op == "begin":
                endpoint.begin(decode(cmd["ticket"], expect=KVTicket))
            elif op == "push":
                endpoint.push(cmd["req_id"], cmd["block_ids"], cmd.get("first_position"))
            elif op == "keepalive":
                reply["alive"] = endpoint.keepalive(cmd["req_id"])
            elif op == "poll":
                reply["status"] = status_to_wire(endpoint.poll(cmd["req_id"]))
            elif op == "wait":
                reply["status"] = status_to_wire(wait_terminal(endpoint, cmd["req_id"], cmd["wait_s"]))
            elif op == "abort":
                reply["aborted"] = endpoint.abort(cmd["req_id"])
            elif op == "read":
                reply["data"] = store.read_blocks(cmd["block_ids"]).float().numpy().tobytes()
            elif op == "stats":
                reply["stats"] = [s.to_dict() for s in endpoint.drain_stats()]
            elif op == "die":
                os._exit(3)
            elif op == "exit":
                endpoint.close()
                conn.send_bytes(msgpack.packb({}))
                return
            else:
                reply["error"] = f"unknown op {op!r}"
        except ValueError as exc:
            reply["error"] = str(exc)
        conn.send_bytes(msgpack.packb(reply))


class PeerProcess:
    """A producer or consumer endpoint in a spawned process, driven by msgpack commands, over
    a block-major pool (or a layer-major one, ``layer_major=True``)."""

    def __init__(self, role: str, layout_spec: dict[str, Any], num_blocks: int, *,
                 seed: int | None = None, config: dict[str, Any] | None = None,
                 node_id: str = "node-0", frames: bool | None = None,
                 layer_major: bool = False, start_timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_peer_main,
            args=(child, role, layout_spec, num_blocks, seed, config or {}, node_id, frames,
                  layer_major),
            daemon=True,
        )
        self.process.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.kill()
            raise RuntimeError("peer process did not start")
        self.address = decode(msgpack.unpackb(self._conn.recv_bytes())["address"],
                              expect=KVEndpoint)

    def call(self, op: str, timeout_s: float = 60.0, **kwargs: Any) -> dict[str, Any]:
        """One command; a ``ticket`` travels both ways as an encoded KVTicket, as it does
        between workers (a malformed one is the peer's ValueError)."""
        if isinstance(kwargs.get("ticket"), KVTicket):
            kwargs["ticket"] = encode(kwargs["ticket"])
        self._conn.send_bytes(msgpack.packb({"op": op, **kwargs}))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer did not answer {op!r} within {timeout_s} s")
        reply = msgpack.unpackb(self._conn.recv_bytes())
        if "error" in reply:
            raise ValueError(reply["error"])
        if "ticket" in reply:
            reply["ticket"] = decode(reply["ticket"], expect=KVTicket)
        return reply

    def freeze(self) -> None:
        """SIGSTOP the peer and return once every one of its threads has stopped (the
        signal is delivered asynchronously: a thread woken meanwhile could still act)."""
        pid = self.process.pid
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                states = [_thread_state(pid, tid) for tid in os.listdir(f"/proc/{pid}/task")]
            except FileNotFoundError:
                return
            if all(st in ("T", "t", None) for st in states):
                return
            time.sleep(0.005)

    def thaw(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def die(self) -> None:
        self._conn.send_bytes(msgpack.packb({"op": "die"}))
        self.process.join(timeout=30)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit", timeout_s=30)
            except (TimeoutError, EOFError, OSError):
                pass
            self.process.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)


def _thread_state(pid: int, tid: str) -> str | None:
    """A thread's scheduler state from /proc (``T``: stopped), None once it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None

"""The Ray actors around the plain worker classes: typed messages as msgpack bytes.

``DecodeWorkerActor`` wraps :class:`decode_pool.worker.DecodeWorker` (dispatch, first
tokens from prefill workers, the routers' token subscriptions, aborts, preemptions);
``PrefillWorkerActor`` wraps :class:`prefill_pool.worker.PrefillWorker`. The classes are
built on first use, so importing this module needs no Ray. Both live here, on the top
floor, because building a worker needs the cluster's configuration and topology; the
pools below know nothing of either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from cluster.config import ClusterConfig
from cluster.messages import pack
from engine.service import bytes_per_block
from scheduler.messages import AbortBatch, Dispatch, PrefilledBatch, StartPrefill, decode, encode


def _info(worker: Any, role: str) -> dict[str, Any]:
    import ray

    return {"worker_id": worker.worker_id, "role": role,
            "location": worker.location.to_dict(),
            "num_total_blocks": worker.engine.num_total_blocks,
            "num_free_blocks": worker.engine.num_free_blocks,
            "bytes_per_block": bytes_per_block(worker.engine),
            "max_model_len": int(worker.engine.max_model_len),
            "ray_node_id": ray.get_runtime_context().get_node_id()}


def _make_decode_actor() -> Any:
    import ray

    @ray.remote
    class DecodeWorkerActor:
        def __init__(self, worker_id: str, index: int, cfg: dict[str, Any],
                     scheduler_name: str, namespace: str) -> None:
            self._args = (worker_id, index, ClusterConfig.from_dict(cfg), scheduler_name,
                          namespace)
            self._w: Any = None

        async def setup(self) -> bytes:
            from cluster.worker_setup import make_decode_worker

            self._w = await make_decode_worker(*self._args)
            return pack(_info(self._w, "decode"))

        async def dispatch(self, msg: bytes) -> bytes:
            return encode(await self._w.dispatch(decode(msg, Dispatch)))

        async def prefilled(self, msg: bytes) -> None:
            await self._w.prefilled(decode(msg, PrefilledBatch))

        async def subscribe(self, router_id: str) -> AsyncIterator[bytes]:
            inner = self._w.subscribe(router_id)
            try:
                async for item in inner:
                    yield item
            finally:
                await inner.aclose()  # now, not at GC: the router's stream is gone

        async def abort(self, req_id: str, error: str | None = None) -> None:
            await self._w.abort(req_id, error)

        async def abort_many(self, msg: bytes) -> None:
            for rid in decode(msg, AbortBatch).req_ids:
                await self._w.abort(rid)

        async def preempt(self, req_id: str, mode: str, for_req_id: str | None) -> bool:
            return await self._w.preempt(req_id, mode, for_req_id)

        async def status(self) -> bytes:
            return pack(self._w.status())

        async def ping(self) -> bool:
            return True

    return DecodeWorkerActor


def _make_prefill_actor() -> Any:
    import ray

    @ray.remote
    class PrefillWorkerActor:
        def __init__(self, worker_id: str, index: int, cfg: dict[str, Any],
                     scheduler_name: str, namespace: str) -> None:
            self._args = (worker_id, index, ClusterConfig.from_dict(cfg), scheduler_name,
                          namespace)
            self._w: Any = None

        async def setup(self) -> bytes:
            from cluster.worker_setup import make_prefill_worker

            self._w = await make_prefill_worker(*self._args)
            return pack(_info(self._w, "prefill"))

        async def start_request(self, msg: bytes) -> str | None:
            return await self._w.start_request(decode(msg, StartPrefill))

        async def abort(self, req_id: str, error: str | None = None) -> None:
            await self._w.abort(req_id, error)

        async def status(self) -> bytes:
            return pack(self._w.status())

        async def ping(self) -> bool:
            return True

    return PrefillWorkerActor


_ACTORS: dict[str, Any] = {}


def decode_worker_actor() -> Any:
    if "decode" not in _ACTORS:
        _ACTORS["decode"] = _make_decode_actor()
    return _ACTORS["decode"]


def prefill_worker_actor() -> Any:
    if "prefill" not in _ACTORS:
        _ACTORS["prefill"] = _make_prefill_actor()
    return _ACTORS["prefill"]

"""Building a worker inside its Ray actor: engine, KV endpoint, policy, links to peers.

Called once from each worker actor's ``setup()``: loads the model (off the event loop),
finds the worker's node / device / NVLink domain, opens the kvtransfer endpoint
(consumer on decode workers, producer on prefill workers), builds the scheduling policy
the worker orders its local queue with, and wires the report channel to the named
global scheduler actor. Every remote call made from here is awaited with a timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.config import ClusterConfig
from cluster.messages import pack
from cluster.worker_runtime import build_engine, locate

RPC_TIMEOUT_S = 10.0


def _policy(cfg: ClusterConfig, bytes_per_block: int) -> Any:
    from cluster.global_scheduler import MeasuredEstimate, default_link_costs
    from scheduler.policies import make_policy
    from scheduler.policy import PolicyContext

    ctx = PolicyContext(cfg.tier_config, MeasuredEstimate(), default_link_costs(bytes_per_block),
                        cfg.pools.block_size)
    return make_policy(cfg.scheduling.policy, ctx)


def _transfer_endpoint(kind: str, engine: Any, location: Any) -> Any:
    import ray

    from kvtransfer import KVConsumer, KVProducer, Location, TransferConfig

    try:
        host = ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        host = "127.0.0.1"
    loc = Location(node_id=location.node, device=location.device,
                   nvlink_domain=location.nvlink_domain, host=host)
    tcfg = TransferConfig(stall_timeout_s=10.0, start_timeout_s=600.0, connect_timeout_s=30.0)
    cls = KVConsumer if kind == "consumer" else KVProducer
    return cls(engine.pool, location=loc, config=tcfg)


async def _actor(name: str, namespace: str) -> Any:
    import ray

    return await asyncio.to_thread(ray.get_actor, name, namespace=namespace)


async def _reporter(scheduler_name: str, namespace: str) -> Any:
    handle = await _actor(scheduler_name, namespace)

    async def report(rep: dict[str, Any]) -> None:
        await asyncio.wait_for(handle.report.remote(pack(rep)), RPC_TIMEOUT_S)

    return report


async def make_decode_worker(worker_id: str, index: int, cfg: ClusterConfig,
                             scheduler_name: str, namespace: str) -> Any:
    from cluster.worker_runtime import bytes_per_block
    from decode_pool.worker import DecodeWorker

    engine = await asyncio.to_thread(build_engine, cfg, role="decode")
    location = locate(cfg, "decode", index, str(engine.pool.kv_layout().device))
    consumer = _transfer_endpoint("consumer", engine, location)
    worker = DecodeWorker(worker_id, cfg, engine, consumer, location,
                          await _reporter(scheduler_name, namespace),
                          _policy(cfg, bytes_per_block(engine)))
    worker.start()
    return worker


async def make_prefill_worker(worker_id: str, index: int, cfg: ClusterConfig,
                              scheduler_name: str, namespace: str) -> Any:
    from cluster.worker_runtime import bytes_per_block
    from prefill_pool.worker import PrefillWorker

    engine = await asyncio.to_thread(build_engine, cfg, role="prefill")
    location = locate(cfg, "prefill", index, str(engine.pool.kv_layout().device))
    producer = _transfer_endpoint("producer", engine, location)
    handles: dict[str, Any] = {}

    async def notify_decode(decode_worker_id: str, msg: dict[str, Any]) -> None:
        if decode_worker_id not in handles:
            handles[decode_worker_id] = await _actor(decode_worker_id, namespace)
        await asyncio.wait_for(handles[decode_worker_id].prefilled.remote(pack(msg)),
                               RPC_TIMEOUT_S)

    worker = PrefillWorker(worker_id, cfg, engine, producer, location,
                           await _reporter(scheduler_name, namespace), notify_decode,
                           _policy(cfg, bytes_per_block(engine)))
    worker.start()
    return worker

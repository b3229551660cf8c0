"""Building a worker inside its Ray actor: engine, KV endpoint, policy, links to peers.

Called once from each worker actor's ``setup()``: loads the model (off the event loop),
finds the worker's node / device / NVLink domain, opens the kvtransfer endpoints
(a consumer and, for migrations out, a producer on decode workers; a producer on prefill
workers), builds the scheduling policy
the worker composes its steps with (its estimate is the worker's own learned
``StepCosts``), and wires its reports to the global scheduler (through its
:class:`~cluster.scheduler_link.SchedulerLink`) and the calls to its peers. Every remote
call made from here is awaited with a timeout; every message is a typed
``scheduler.messages`` message.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.config import ClusterConfig
from cluster.scheduler_link import SchedulerLink
from cluster.worker_runtime import build_engine, locate
from engine.service import bytes_per_block
from scheduler.links import LinkModel, prior_link_costs
from scheduler.messages import (
    MigrateAnswer,
    MigrateIn,
    PrefilledBatch,
    StartPrefill,
    decode,
    encode,
)
from scheduler.step_costs import StepCosts, cost_prior
from scheduler.step_planner import WorkerLimits
from scheduler.topology import WorkerRole

RPC_TIMEOUT_S = 10.0


def peer_timeout(cfg: ClusterConfig) -> float:
    """A call to a peer made inside a call from the scheduler (a dispatch starting its
    prefill, a migration asking its target) must give up before the scheduler's call does, or a slow peer would look like
    a dead caller."""
    return min(RPC_TIMEOUT_S, cfg.router.rpc_timeout_s / 2)


def limits(cfg: ClusterConfig) -> WorkerLimits:
    p = cfg.pools
    return WorkerLimits(p.block_size, p.max_num_seqs, max(p.max_num_batched_tokens, p.max_num_seqs),
                        p.prefill_chunk_size)


def worker_policy(cfg: ClusterConfig, engine: Any, costs: StepCosts,
                  links: Any = None) -> Any:
    """The policy a worker composes its steps with; ``links``: the link model it prices
    its own KV-pressure victims' swaps with (default: the device's priors)."""
    from scheduler.policies import make_policy
    from scheduler.policy import PolicyContext

    if links is None:
        links = prior_link_costs(bytes_per_block(engine), str(engine.pool.kv_layout().device))
    ctx = PolicyContext(cfg.tier_config, costs, links, cfg.pools.block_size)
    return make_policy(cfg.scheduling.policy, ctx)


def _transfer_endpoint(kind: str, engine: Any, location: Any) -> Any:
    import ray

    from kvtransfer import KVConsumer, KVLocation, KVProducer, TransferConfig

    try:
        host = ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        host = "127.0.0.1"
    loc = KVLocation(node_id=location.node, device=location.device,
                     nvlink_domain=location.nvlink_domain, host=host)
    # The timeouts are for a hung peer (a dead one is seen at once): a transfer whose prompt
    # the prefill worker holds back (queued, or paused between chunks while more urgent
    # prompts run) is kept alive by its keepalives, so the defaults need no padding for it
    # (they were 60 s / 600 s, which also left a stuck prefill worker unnoticed that long).
    tcfg = TransferConfig(stall_timeout_s=10.0, start_timeout_s=120.0, connect_timeout_s=30.0)
    cls = KVConsumer if kind == "consumer" else KVProducer
    return cls(engine.pool, location=loc, config=tcfg)


async def _actor(name: str, namespace: str) -> Any:
    import ray

    return await asyncio.to_thread(ray.get_actor, name, namespace=namespace)


def _peer_caller(namespace: str) -> Any:
    handles: dict[str, Any] = {}

    async def handle(worker_id: str) -> Any:
        if worker_id not in handles:
            handles[worker_id] = await _actor(worker_id, namespace)
        return handles[worker_id]

    return handle


def _costs(cfg: ClusterConfig, engine: Any) -> StepCosts:
    device = str(engine.pool.kv_layout().device)
    return StepCosts(cost_prior(device), chunk_tokens=cfg.pools.prefill_chunk_size)


async def make_decode_worker(worker_id: str, index: int, cfg: ClusterConfig,
                             link: SchedulerLink, namespace: str) -> Any:
    from decode_pool.worker import DecodeWorker

    engine = await asyncio.to_thread(build_engine, cfg, role="decode")
    device = str(engine.pool.kv_layout().device)
    location = locate(cfg, "decode", index, device)
    consumer = _transfer_endpoint("consumer", engine, location)
    # Migrations out: this worker's blocks to another decode worker's consumer (a pair
    # group of its own per target, built on first use like any other).
    producer = _transfer_endpoint("producer", engine, location)
    peer = _peer_caller(namespace)

    async def start_prefill(prefill_worker_id: str, msg: StartPrefill) -> str | None:
        h = await peer(prefill_worker_id)
        return await asyncio.wait_for(h.start_request.remote(encode(msg)), peer_timeout(cfg))

    async def migrate(target_worker_id: str, msg: MigrateIn) -> MigrateAnswer:
        h = await peer(target_worker_id)
        got = await asyncio.wait_for(h.migrate_in.remote(encode(msg)), peer_timeout(cfg))
        return decode(got, MigrateAnswer)

    costs = _costs(cfg, engine)
    links = LinkModel(prior_link_costs(bytes_per_block(engine), device))
    info = location.to_worker_info(worker_id, WorkerRole.DECODE, engine.num_total_blocks)
    worker = DecodeWorker(info, engine, consumer, worker_policy(cfg, engine, costs, links),
                          costs, limits(cfg), link.report, start_prefill,
                          control_interval_s=cfg.scheduling.control_interval_s,
                          producer=producer, migrate=migrate, links=links)
    worker.location = location
    worker.start()
    return worker


async def make_prefill_worker(worker_id: str, index: int, cfg: ClusterConfig,
                              link: SchedulerLink, namespace: str) -> Any:
    from prefill_pool.worker import PrefillWorker

    engine = await asyncio.to_thread(build_engine, cfg, role="prefill")
    location = locate(cfg, "prefill", index, str(engine.pool.kv_layout().device))
    producer = _transfer_endpoint("producer", engine, location)
    peer = _peer_caller(namespace)

    async def notify_decode(decode_worker_id: str, batch: PrefilledBatch) -> None:
        h = await peer(decode_worker_id)
        await asyncio.wait_for(h.prefilled.remote(encode(batch)), RPC_TIMEOUT_S)

    costs = _costs(cfg, engine)
    info = location.to_worker_info(worker_id, WorkerRole.PREFILL, engine.num_total_blocks)
    worker = PrefillWorker(info, engine, producer, worker_policy(cfg, engine, costs), costs,
                           limits(cfg), link.report, notify_decode,
                           control_interval_s=cfg.scheduling.control_interval_s)
    worker.location = location
    worker.start()
    return worker

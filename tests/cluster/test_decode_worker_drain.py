"""The decode worker frees a reservation only once its transfer can no longer write into it.

A real engine (a tiny random Llama) and a real DecodeWorker; its KVConsumer and the prefill
side's KVProducer talk over the in-process mock backend (the layer under test is the worker,
not the transport). On the posted path an aborted transfer keeps its receives posted until
the producer releases them, so the worker must not hand the slots to anyone before that.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from cluster.config import ClusterConfig
from cluster.worker_runtime import build_engine
from cluster.worker_setup import limits, worker_policy
from decode_pool.worker import DecodeWorker
from engine.service import bytes_per_block
from engine.testing import make_tiny_checkpoint
from kvtransfer import (
    KVConsumer,
    KVLocation,
    KVProducer,
    MockBackend,
    MockHub,
    TensorKVStore,
    TransferConfig,
)
from scheduler.messages import Dispatch, GenerationSpec, KVTicket, SamplingSpec, StartPrefill
from scheduler.step_costs import CPU_PRIOR, StepCosts
from scheduler.topology import WorkerInfo, WorkerRole

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


def _dispatch(req_id: str, n: int) -> Dispatch:
    spec = GenerationSpec(req_id, tuple(range(3, 3 + n)),
                          SamplingSpec(max_tokens=4, temperature=0.0), tier=1, tenant="t",
                          arrival_time=time.time())
    return Dispatch(spec, "prefill-0", -(-n // 4))


def test_an_aborted_reservation_is_freed_only_after_its_transfer_ended(tiny_path):
    cfg = ClusterConfig.from_dict({"model": {"path": str(tiny_path), "dtype": "float32"},
                                   "pools": {"num_kv_blocks": 64, "block_size": 4}})
    engine = build_engine(cfg, role="decode")
    hub = MockHub()
    tcfg = TransferConfig(stall_timeout_s=5.0, part_bytes=2 * bytes_per_block(engine))
    consumer = KVConsumer(engine.pool, location=KVLocation("n0"), config=tcfg, backend=MockBackend(hub))
    layout = consumer.layout
    source = TensorKVStore(layout, 16, fill="random")
    producer = KVProducer(source, location=KVLocation("n0"), config=tcfg, backend=MockBackend(hub))
    freed: list[tuple[bool, bool]] = []  # (transfer terminal, receives released) at each free
    records = {}
    engine_abort = engine.abort

    def watched_abort(req_id: str) -> None:
        record = records.get(req_id)
        if record is not None:
            freed.append((record.state.is_terminal, record.works is None))
        engine_abort(req_id)

    engine.abort = watched_abort
    events: list[object] = []
    tickets: dict[str, KVTicket] = {}

    async def report(rep: object) -> None:
        events.append(rep)

    async def start_prefill(prefill_worker_id: str, msg: StartPrefill) -> str | None:
        tickets[msg.spec.req_id] = msg.ticket
        return None

    async def scenario() -> None:
        costs = StepCosts(CPU_PRIOR)
        info = WorkerInfo("decode-0", WorkerRole.DECODE, "n0", "cpu", "d0",
                          engine.num_total_blocks)
        worker = DecodeWorker(info, engine, consumer, worker_policy(cfg, engine, costs), costs,
                              limits(cfg), report, start_prefill)
        worker.start()
        try:
            total = engine.num_free_blocks
            reply = await worker.dispatch(_dispatch("r1", 16))  # 4 blocks: 2 segments
            assert reply.ok and engine.num_free_blocks == total - 4
            records["r1"] = consumer.table.get("r1")
            producer.begin(tickets["r1"])
            await asyncio.sleep(0.2)  # Open and Ready
            producer.push("r1", [5, 6])  # the first segment lands
            deadline = time.monotonic() + 10
            while consumer.poll("r1").num_blocks_done < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await worker.abort("r1")  # the second segment's receive is still posted
            deadline = time.monotonic() + 10
            while engine.num_free_blocks < total and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert engine.num_free_blocks == total
            assert freed == [(True, True)]  # freed once the transfer ended, receives released
            assert consumer.poll("r1") is None  # forgotten
            # a reservation whose transfer never opened is freed at once
            reply = await worker.dispatch(_dispatch("r2", 8))
            assert reply.ok
            records["r2"] = consumer.table.get("r2")
            await worker.abort("r2")  # answered before the engine thread frees the blocks
            deadline = time.monotonic() + 10
            while engine.num_free_blocks < total and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert engine.num_free_blocks == total and freed[-1] == (True, True)
        finally:
            await worker.stop()

    try:
        asyncio.run(scenario())
    finally:
        producer.close()
        consumer.close()

"""The prefill worker over a stub engine (engine/stub.py: the real block pool, admission and
``run_plan``, no model) and a real producer streaming into a real consumer over the
in-process mock backend; no Ray. What a sustained overload showed (issue 22 item 4): a
prefill worker that went tens of seconds without finishing a prefill, and transfers that
failed while both peers were alive."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from cluster.config import ClusterConfig
from cluster.worker_setup import limits, worker_policy
from engine.stub import make_stub_engine
from kvtransfer import (
    KVConsumer,
    KVLayout,
    KVProducer,
    Location,
    MockBackend,
    MockHub,
    TensorKVStore,
    TransferConfig,
    TransferState,
)
from prefill_pool.worker import PrefillWorker
from scheduler.messages import (
    GenerationSpec,
    Prefilled,
    PrefilledBatch,
    SamplingSpec,
    StartPrefill,
    WorkerEvent,
    WorkerReport,
)
from scheduler.step_costs import CPU_PRIOR, StepCosts
from scheduler.topology import WorkerInfo, WorkerRole

torch.set_num_threads(1)

BS = 4  # tokens per block
WAIT_S = 30.0  # a bound on waiting for a state, never a measurement


@dataclass
class Rig:
    worker: PrefillWorker
    engine: Any
    producer: KVProducer
    consumer: KVConsumer
    reports: list[WorkerReport] = field(default_factory=list)
    prefilled: list[Prefilled] = field(default_factory=list)

    def delivered(self, kind: WorkerEvent) -> set[str]:
        return {e.req_id for rep in self.reports for e in rep.events if e.event is kind}


def _cfg(policy: str, num_blocks: int, chunk: int) -> ClusterConfig:
    return ClusterConfig.from_dict({
        "model": {"path": "stub"},
        "pools": {"mode": "aggregated", "num_prefill": 0, "block_size": BS,
                  "num_kv_blocks": num_blocks, "prefill_chunk_size": chunk,
                  "max_num_batched_tokens": chunk, "max_num_seqs": 8},
        "scheduling": {"policy": policy}})


def make_rig(policy: str, *, num_blocks: int, chunk: int, tcfg: TransferConfig | None = None,
             report: Callable[[WorkerReport], Any] | None = None) -> Rig:
    cfg = _cfg(policy, num_blocks, chunk)
    engine = make_stub_engine(num_blocks, BS, max_num_seqs=8, max_num_batched_tokens=chunk)
    tcfg = tcfg or TransferConfig(stall_timeout_s=5.0, start_timeout_s=30.0)
    hub = MockHub()
    producer = KVProducer(engine.pool, location=Location("n0"), config=tcfg,
                          backend=MockBackend(hub))
    dst = TensorKVStore(KVLayout.of(engine.pool.kv_layout()), 256)
    consumer = KVConsumer(dst, location=Location("n0"), config=tcfg, backend=MockBackend(hub))
    costs = StepCosts(CPU_PRIOR)
    info = WorkerInfo("prefill-0", WorkerRole.PREFILL, "n0", "cpu", "d0", engine.num_total_blocks)
    holder: list[Rig] = []

    async def default_report(rep: WorkerReport) -> bool:
        holder[0].reports.append(rep)
        return True

    async def notify(decode_worker_id: str, batch: PrefilledBatch) -> None:
        holder[0].prefilled.extend(batch.items)

    worker = PrefillWorker(info, engine, producer, worker_policy(cfg, engine, costs), costs,
                           limits(cfg), report or default_report, notify,
                           control_interval_s=0.05)
    rig = Rig(worker, engine, producer, consumer)
    holder.append(rig)
    return rig


def _spec(req_id: str, num_tokens: int, tier: int) -> GenerationSpec:
    prompt = tuple((7 * i + len(req_id)) % 500 + 1 for i in range(num_tokens))
    return GenerationSpec(req_id, prompt, SamplingSpec(max_tokens=4, temperature=0.0),
                          tier=tier, tenant="t", arrival_time=time.time(), router_id="r")


_next_slot = [0]


async def start(rig: Rig, req_id: str, num_tokens: int, tier: int) -> None:
    """What a decode worker does: reserve the slots, hand the ticket to the prefill worker."""
    n = -(-num_tokens // BS)
    slots = list(range(_next_slot[0], _next_slot[0] + n))
    _next_slot[0] = (_next_slot[0] + n) % 128
    ticket = rig.consumer.expect(req_id, slots)
    refusal = await rig.worker.start_request(StartPrefill(_spec(req_id, num_tokens, tier),
                                                          "decode-0", ticket))
    assert refusal is None


async def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.005)


def close(rig: Rig) -> None:
    rig.producer.close()
    rig.consumer.close()


@pytest.mark.parametrize("policy", ["tierserve", "vllm-priority"])
def test_a_started_prompt_keeps_its_blocks_and_finishes(policy: str) -> None:
    """A prompt of more than half the pool: once its first chunk ran it holds all of its
    blocks, so its next chunks need none. The worker told its step planner nothing of
    those blocks, and the planner asked for the whole prompt's blocks again before every
    later chunk: the prompt waited, holding them, for room that only its own end could
    free (in the cluster, until its transfer's stall timeout ended it)."""
    rig = make_rig(policy, num_blocks=16, chunk=8)
    stuck: list[str] = []

    async def scenario() -> None:
        rig.worker.start()
        try:
            await start(rig, "long", 40, tier=1)  # 10 of the 16 blocks, in 5 chunks
            await until(lambda: "long" in {p.req_id for p in rig.prefilled}
                        or _stuck(rig.worker), "the prefill ends or the worker stops planning")
            if _stuck(rig.worker):
                stuck.append(f"free {rig.engine.num_free_blocks} of 16, computed "
                             f"{rig.worker.sched.local['long'].num_computed} of 40 tokens")
                return
            await until(lambda: rig.consumer.poll("long").state.is_terminal, "transfer ends")
        finally:
            await rig.worker.stop()

    try:
        asyncio.run(scenario())
    finally:
        close(rig)
    assert not stuck, f"the worker holds a started prompt it never plans again: {stuck[0]}"
    assert rig.consumer.poll("long").state is TransferState.DONE
    assert [p.error for p in rig.prefilled] == [None]


def _stuck(worker: PrefillWorker) -> bool:
    """The worker has a started prefill and plans nothing for it: nothing else will ever
    free a block here (a planner that waits for room re-plans every step)."""
    lr = worker.sched.local.get("long")
    return (lr is not None and lr.num_computed > 0 and worker._plan_was_empty
            and worker.sched.has_work() and worker.num_steps > 0)

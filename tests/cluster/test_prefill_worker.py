"""The prefill worker over a stub engine (engine/stub.py: the real block pool, admission and
``run_plan``, no model) and a real producer streaming into a real consumer over the
in-process mock backend; no Ray. What a sustained overload showed (issue 22 item 4): a
prefill worker that went tens of seconds without finishing a prefill, and transfers that
failed while both peers were alive."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
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
    KVLocation,
    KVProducer,
    MockBackend,
    MockHub,
    TensorKVStore,
    TransferConfig,
    TransferState,
)
from prefill_pool.worker import PrefillWorker
from scheduler.block_hashes import compute_block_hashes
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
    prefilled: list[Prefilled] = field(default_factory=list)  # what the decode side got
    next_slot: int = 0  # the consumer's next free slot


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
    producer = KVProducer(engine.pool, location=KVLocation("n0"), config=tcfg,
                          backend=MockBackend(hub))
    dst = TensorKVStore(KVLayout.of(engine.pool.kv_layout()), 256)
    consumer = KVConsumer(dst, location=KVLocation("n0"), config=tcfg, backend=MockBackend(hub))
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


async def start(rig: Rig, req_id: str, num_tokens: int, tier: int) -> None:
    """What a decode worker does: reserve the slots, hand the ticket to the prefill worker."""
    n = -(-num_tokens // BS)
    slots = list(range(rig.next_slot, rig.next_slot + n))
    rig.next_slot += n
    ticket = rig.consumer.expect(req_id, slots)
    spec = _spec(req_id, num_tokens, tier)  # the dispatch carries the prompt's hashes
    hashes = tuple(compute_block_hashes(list(spec.prompt_token_ids), BS))
    refusal = await rig.worker.start_request(StartPrefill(spec, "decode-0", ticket, hashes))
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
                             f"{rig.worker.core.planner.local['long'].num_computed} of 40 tokens")
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
    lr = worker.core.planner.local.get("long")
    return (lr is not None and lr.num_computed > 0 and worker.core.plan_was_empty
            and worker.core.planner.has_work() and worker.num_steps > 0)


class SlowRunner:
    """The stub's runner, each step taking at least ``delay_s`` (a slow model's compute)."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.kernels = getattr(inner, "kernels", None)

    def execute(self, decodes: Any, chunks: Any) -> Any:
        time.sleep(self.delay_s)
        return self.inner.execute(decodes, chunks)


# Timeouts far below the pause the policy makes below (at least 30 steps of 50 ms).
SHORT = TransferConfig(stall_timeout_s=0.5, start_timeout_s=0.5)


@pytest.mark.parametrize("policy", ["tierserve", "vllm-priority"])
def test_transfers_the_policy_pauses_past_the_timeouts_stay_alive(policy: str) -> None:
    """A queued tier-3 prompt (and, under tierserve's tier order, a started one) waits while
    a long tier-0 prompt takes every step's whole token budget, for longer than the
    transfers' stall and start timeouts; the tier-0 prompt's one segment leaves only after
    its last chunk. Both peers are alive throughout, so every transfer completes (the old
    clocks failed them: 'no block was pushed within the start timeout', 'the producer did
    not start within the start timeout')."""
    rig = make_rig(policy, num_blocks=128, chunk=8, tcfg=SHORT)
    rig.engine.runner = SlowRunner(rig.engine.runner, 0.05)

    async def scenario() -> None:
        rig.worker.start()
        try:
            await start(rig, "started", 128, tier=3)  # 16 chunks of 8 tokens
            await until(lambda: rig.worker.core.planner.local["started"].num_computed > 0,
                        "the tier-3 prompt's first chunk ran")
            await start(rig, "urgent", 240, tier=0)  # 30 steps, each all of the budget
            await start(rig, "queued", 8, tier=3)
            await until(lambda: len(rig.prefilled) == 3, "every prompt prefilled")
            await until(lambda: all(rig.consumer.poll(r).state.is_terminal
                                    for r in ("started", "urgent", "queued")),
                        "every transfer ends")
        finally:
            await rig.worker.stop()

    try:
        asyncio.run(scenario())
        states = {r: rig.consumer.poll(r) for r in ("started", "urgent", "queued")}
    finally:
        close(rig)
    order = [p.req_id for p in rig.prefilled]
    assert order.index("urgent") < order.index("queued"), order  # it waited 30 steps or more
    if policy == "tierserve":  # tier order: the started prompt waited too
        assert order.index("urgent") < order.index("started"), order
    assert {r: (s.state.value, s.detail) for r, s in states.items()} == {
        r: ("done", "") for r in states}
    assert [p.error for p in rig.prefilled] == [None, None, None]


class HangingRunner:
    """The stub's runner; once ``hang`` is set, the next step blocks until ``release``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.kernels = getattr(inner, "kernels", None)
        self.hang = threading.Event()
        self.hanging = threading.Event()
        self.release = threading.Event()

    def execute(self, decodes: Any, chunks: Any) -> Any:
        if self.hang.is_set():
            self.hanging.set()
            self.release.wait()
        return self.inner.execute(decodes, chunks)


def test_a_worker_whose_step_hangs_keeps_no_transfer_alive() -> None:
    """Keepalives come from the turns of the step loop: a step that never ends stops them,
    and the decode side's consumer fails the transfer of this worker on its timeout (the
    hung worker is found, as before the keepalives)."""
    rig = make_rig("tierserve", num_blocks=128, chunk=8, tcfg=SHORT)
    runner = HangingRunner(SlowRunner(rig.engine.runner, 0.05))
    rig.engine.runner = runner

    async def scenario() -> None:
        rig.worker.start()
        try:
            await start(rig, "started", 64, tier=3)  # eight chunks
            await until(lambda: rig.worker.core.planner.local["started"].num_computed > 0,
                        "the first chunk ran")
            runner.hang.set()
            await until(runner.hanging.is_set, "a later chunk's step hangs")
            await until(lambda: rig.consumer.poll("started").state.is_terminal,
                        "the consumer ends the transfer of the hung worker")
        finally:
            runner.release.set()
            await rig.worker.stop()

    try:
        asyncio.run(scenario())
        status = rig.consumer.poll("started")
    finally:
        close(rig)
    assert (status.state, status.reason.value) == (TransferState.FAILED, "timeout"), status


@pytest.mark.parametrize("failure", ["raises", "not delivered"])
def test_a_report_that_fails_keeps_its_events_for_the_next(failure: str) -> None:
    """The report that carries a PREFILL_DONE does not reach the scheduler (its RPC raised,
    or the link says it was not delivered): the event goes with the next report. Lost, the
    scheduler's book would keep the prefill as this worker's queued work."""
    failed: list[WorkerReport] = []
    delivered: list[WorkerReport] = []

    async def report(rep: WorkerReport) -> bool:
        if not failed and any(e.event is WorkerEvent.PREFILL_DONE for e in rep.events):
            failed.append(rep)
            if failure == "raises":
                raise TimeoutError("the scheduler did not answer")
            return False
        delivered.append(rep)
        return True

    rig = make_rig("tierserve", num_blocks=64, chunk=8, report=report)

    async def scenario() -> None:
        rig.worker.start()
        try:
            await start(rig, "r1", 16, tier=1)
            await until(lambda: bool(failed), "the report with the first token fails")
            n = len(delivered)
            await until(lambda: len(delivered) > n, "a later report is delivered")
        finally:
            await rig.worker.stop()

    try:
        asyncio.run(scenario())
    finally:
        close(rig)
    done = [e for rep in delivered for e in rep.events if e.event is WorkerEvent.PREFILL_DONE]
    assert [e.req_id for e in done] == ["r1"]
    assert done[0] == next(e for e in failed[0].events if e.event is WorkerEvent.PREFILL_DONE)
    # It says when the prompt reached this worker and when its first chunk's step began:
    # the global scheduler splits its time to first token with them.
    assert 0 < done[0].received <= done[0].started <= done[0].time


def test_a_prompt_started_during_a_step_is_planned_for_the_next_one() -> None:
    """Issue 22 item 6: the engine's add of a new prompt queues behind the step running
    on the engine thread; the worker used to await it before the planner knew the prompt,
    so the step loop planned the step after the running one without it (an urgent prompt
    waited for two chunks of other prompts). The planner now holds it while the step
    still runs, and it is prefilled and sent like any other."""
    rig = make_rig("tierserve", num_blocks=128, chunk=8)
    runner = HangingRunner(SlowRunner(rig.engine.runner, 0.01))
    rig.engine.runner = runner

    async def scenario() -> None:
        rig.worker.start()
        try:
            await start(rig, "low", 64, tier=3)  # eight chunks
            await until(lambda: rig.worker.core.planner.local["low"].num_computed > 0,
                        "the first chunk ran")
            runner.hang.set()
            await until(runner.hanging.is_set, "a later chunk's step is running")
            urgent = asyncio.ensure_future(start(rig, "urgent", 8, tier=0))
            await until(lambda: "urgent" in rig.worker.core.planner.local,
                        "the planner holds the urgent prompt while the step runs")
            assert not urgent.done()  # its engine add still waits for the running step
            runner.hang.clear()
            runner.release.set()
            await urgent
            await until(lambda: {p.req_id for p in rig.prefilled} >= {"urgent", "low"},
                        "both prompts were prefilled")
        finally:
            runner.release.set()
            await rig.worker.stop()

    try:
        asyncio.run(scenario())
    finally:
        close(rig)
    assert all(p.error is None for p in rig.prefilled)


def test_a_prompt_the_engine_refuses_is_answered_and_leaves_nothing_behind() -> None:
    rig = make_rig("tierserve", num_blocks=128, chunk=8)

    async def scenario() -> str | None:
        rig.worker.start()
        try:
            spec = _spec("bad", 8, 0)
            bad = GenerationSpec(spec.req_id, (10**9,), spec.sampling, tier=0, tenant="t",
                                 arrival_time=spec.arrival_time, router_id="r")
            ticket = rig.consumer.expect("bad", [0])
            return await rig.worker.start_request(StartPrefill(bad, "decode-0", ticket))
        finally:
            await rig.worker.stop()

    try:
        refusal = asyncio.run(scenario())
    finally:
        close(rig)
    assert refusal is not None and refusal.startswith("invalid:"), refusal
    assert "bad" not in rig.worker.core.planner.local and "bad" not in rig.worker.core.jobs


def test_a_ticket_the_producer_refuses_leaves_nothing_in_the_engine() -> None:
    """The ticket is checked before the engine takes the prompt: a refused one is answered
    ``invalid`` and no request is left holding blocks with no job to release them."""
    rig = make_rig("tierserve", num_blocks=128, chunk=8)

    async def scenario() -> str | None:
        rig.worker.start()
        try:
            ticket = dataclasses.replace(rig.consumer.expect("t", [0]), secret="")
            return await rig.worker.start_request(StartPrefill(_spec("t", 8, 0), "decode-0",
                                                               ticket))
        finally:
            await rig.worker.stop()

    try:
        refusal = asyncio.run(scenario())
    finally:
        close(rig)
    assert refusal is not None and refusal.startswith("invalid:"), refusal
    assert rig.worker.core.jobs == {} and rig.engine.request_state("t") is None

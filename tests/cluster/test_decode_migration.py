"""A decoding request moves between two real DecodeWorkers with its KV and finishes with
the tokens of an undisturbed greedy run; a move that fails falls back to a recompute on
the source, and a refused one leaves the request decoding where it was.

Real engines (a tiny random Llama, fp32) and real DecodeWorkers; their KVProducer and
KVConsumer talk over kvtransfer's in-process mock backend (the layer under test is the
worker; tests/cluster/test_kv_memory.py runs the same over gloo between Ray actors). The
tokens of both workers' streams go through the router's own merge (``_Live.accept``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import torch

from cluster.backend import _Live
from cluster.config import ClusterConfig
from cluster.worker_runtime import build_engine
from cluster.worker_setup import limits, worker_policy
from decode_pool.worker import DecodeWorker
from engine import SamplingParams
from engine.testing import make_tiny_checkpoint
from kvtransfer import KVConsumer, KVLocation, KVProducer, MockBackend, MockHub, TransferConfig
from scheduler.messages import (
    Dispatch,
    GenerationSpec,
    MigrateAnswer,
    MigrateIn,
    PreemptMode,
    SamplingSpec,
    TokenBatch,
    WorkerEvent,
    WorkerReport,
    decode,
)
from scheduler.step_costs import CPU_PRIOR, StepCosts
from scheduler.topology import WorkerInfo, WorkerRole

torch.set_num_threads(1)
PROMPT = tuple((11 * k + 5) % 250 for k in range(70))
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(tiny_path: Path) -> list[int]:
    cfg = ClusterConfig.from_dict({"model": {"path": str(tiny_path), "dtype": "float32"},
                                   "pools": {"num_kv_blocks": 64}})
    return build_engine(cfg, role="decode").generate([list(PROMPT)],
                                                     SamplingParams(max_tokens=MAX_TOKENS))[0]


MigrateFn = Callable[[str, MigrateIn], Awaitable[MigrateAnswer]]


class Pair:
    """Two decode workers on one mock hub; ``a`` migrates to ``b`` through ``via``."""

    def __init__(self, path: Path, via: Callable[[Pair], MigrateFn] | None = None) -> None:
        cfg = ClusterConfig.from_dict({"model": {"path": str(path), "dtype": "float32"},
                                       "pools": {"num_kv_blocks": 64, "num_swap_blocks": 16}})
        self.reports: dict[str, list[WorkerReport]] = {"a": [], "b": []}
        hub = MockHub()
        tcfg = TransferConfig(stall_timeout_s=5.0)
        self.workers: dict[str, DecodeWorker] = {}
        self.endpoints: list[object] = []
        for name in ("a", "b"):
            engine = build_engine(cfg, role="decode")
            consumer = KVConsumer(engine.pool, location=KVLocation("n0"), config=tcfg,
                                  backend=MockBackend(hub))
            producer = KVProducer(engine.pool, location=KVLocation("n0"), config=tcfg,
                                  backend=MockBackend(hub))
            self.endpoints += [consumer, producer]
            costs = StepCosts(CPU_PRIOR)
            info = WorkerInfo(name, WorkerRole.DECODE, "n0", "cpu", f"d-{name}",
                              engine.num_total_blocks)

            async def report(rep: WorkerReport, name: str = name) -> None:
                self.reports[name].append(rep)

            async def no_prefill(*_: object) -> str | None:
                return "no prefill workers here"

            migrate = via(self) if via is not None else self._to_b
            self.workers[name] = DecodeWorker(
                info, engine, consumer, worker_policy(cfg, engine, costs), costs, limits(cfg),
                report, no_prefill, control_interval_s=0.05, producer=producer,
                migrate=migrate)

    async def _to_b(self, target: str, msg: MigrateIn) -> MigrateAnswer:
        return await self.workers[target].migrate_in(msg)

    def events(self, name: str) -> list[tuple[str, WorkerEvent, str]]:
        return [(e.req_id, e.event, e.reason) for rep in self.reports[name] for e in rep.events]

    def close(self) -> None:
        for e in self.endpoints:
            e.close()  # type: ignore[attr-defined]


async def _tokens(worker: DecodeWorker, live: _Live, name: str) -> None:
    stream: AsyncIterator[bytes] = worker.subscribe("router-0")
    async for raw in stream:
        for d in decode(raw, TokenBatch).deltas:
            for kept in live.accept(d, name):
                live.queue.put_nowait(kept)


async def _run(pair: Pair, action: Callable[[], Awaitable[None]]) -> list[int]:
    """Start the request on ``a``; once it decoded a few tokens run ``action``; return
    every token the router handed on, in order."""
    spec = GenerationSpec("req", PROMPT, SamplingSpec(MAX_TOKENS, temperature=0.0), tier=2,
                          tenant="t", arrival_time=time.time(), router_id="router-0")
    live = _Live(asyncio.Queue())
    for w in pair.workers.values():
        w.start()
    readers = [asyncio.create_task(_tokens(w, live, n)) for n, w in pair.workers.items()]
    try:
        answer = await pair.workers["a"].dispatch(Dispatch(spec, None, -(-71 // 16)))
        assert answer.ok, answer
        out: list[int] = []
        acted = False
        while True:
            d = await asyncio.wait_for(live.queue.get(), 60)
            assert d.error is None, d.error
            out.extend(d.token_ids)
            if not acted and len(out) >= 6:
                acted = True
                await action()
            if d.finish is not None:
                return out
    finally:
        for t in readers:
            t.cancel()
        for w in pair.workers.values():
            await w.stop()


def _pools_full(pair: Pair) -> bool:
    return all(w.engine.num_free_blocks == w.engine.num_total_blocks
               for w in pair.workers.values())


async def _settle(pair: Pair) -> None:
    for _ in range(200):
        if _pools_full(pair):
            return
        await asyncio.sleep(0.02)


def test_a_migrated_request_finishes_on_the_target_token_for_token(tiny_path, reference):
    pair = Pair(tiny_path)
    moved: list[bool] = []

    async def migrate() -> None:
        moved.append(await pair.workers["a"].preempt("req", PreemptMode.MIGRATE, None, "b"))

    async def scenario() -> list[int]:
        out = await _run(pair, migrate)
        await _settle(pair)
        return out

    try:
        out = asyncio.run(scenario())
    finally:
        pair.close()
    assert moved == [True]
    assert out == reference  # no gap, no repeated token, the same greedy tokens
    assert ("req", WorkerEvent.PREEMPTED_MIGRATE, "") in pair.events("a")
    assert ("req", WorkerEvent.RESUMED_MIGRATE, "") in pair.events("b")
    finishes = [e for e in pair.events("b") if e[1] is WorkerEvent.FINISHED_LENGTH]
    assert finishes and not any(e[1] is WorkerEvent.FINISHED_LENGTH for e in pair.events("a"))
    assert _pools_full(pair)
    restores = [r for rep in pair.reports["b"] if rep.memory for r in rep.memory.restores]
    assert [(r.mode, r.from_worker_id) for r in restores] == [(PreemptMode.MIGRATE, "a")]
    samples = [s for rep in pair.reports["a"] if rep.memory for s in rep.memory.link_samples]
    assert any(s.peer_worker_id == "b" and s.num_bytes > 0 for s in samples)


def test_a_move_whose_target_gives_up_mid_transfer_is_recomputed_on_the_source(tiny_path,
                                                                              reference):
    """The target reserved and answered, then dropped the request before any block
    landed (as a target that dies does): the source's transfer fails and it recomputes
    the request itself, streaming on without a gap."""

    def via(pair: Pair) -> MigrateFn:
        async def reserve_then_vanish(target: str, msg: MigrateIn) -> MigrateAnswer:
            ans = await pair.workers[target].migrate_in(msg)
            await pair.workers[target].abort(msg.spec.req_id)
            return ans
        return reserve_then_vanish

    pair = Pair(tiny_path, via)

    async def scenario() -> list[int]:
        async def migrate() -> None:
            assert await pair.workers["a"].preempt("req", PreemptMode.MIGRATE, None, "b")

        out = await _run(pair, migrate)
        await _settle(pair)
        return out

    try:
        out = asyncio.run(scenario())
    finally:
        pair.close()
    assert out == reference
    events = pair.events("a")
    assert any(e[1] is WorkerEvent.PREEMPTED_RECOMPUTE and "transfer" in e[2] for e in events)
    assert ("req", WorkerEvent.RESUMED_RECOMPUTE, "") in events
    assert not any(e[1] is WorkerEvent.RESUMED_MIGRATE for e in pair.events("b"))
    assert _pools_full(pair)


def test_a_refused_move_leaves_the_request_decoding_on_the_source(tiny_path, reference):
    def via(pair: Pair) -> MigrateFn:
        async def refuse(target: str, msg: MigrateIn) -> MigrateAnswer:
            return MigrateAnswer(msg.spec.req_id, None, "no room")
        return refuse

    pair = Pair(tiny_path, via)
    answers: list[bool] = []

    async def scenario() -> list[int]:
        async def migrate() -> None:
            answers.append(await pair.workers["a"].preempt("req", PreemptMode.MIGRATE, None, "b"))
            # A swap and a recompute of the same request on the way, for good measure.
            answers.append(await pair.workers["a"].preempt("req", PreemptMode.SWAP, None))

        out = await _run(pair, migrate)
        await _settle(pair)
        return out

    try:
        out = asyncio.run(scenario())
    finally:
        pair.close()
    assert answers == [False, True]
    assert out == reference
    kinds = [e[1] for e in pair.events("a")]
    assert WorkerEvent.PREEMPTED_SWAP in kinds and WorkerEvent.RESUMED_SWAP in kinds
    assert WorkerEvent.PREEMPTED_MIGRATE not in kinds
    assert _pools_full(pair)

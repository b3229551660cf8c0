"""How the global scheduler keeps the cluster whole, over fake workers (no Ray): workers
register themselves and a new incarnation replaces the old one, a restarted scheduler
adopts what the workers hold and settles with the routers' claims, a dead prefill worker
ends only what its decode workers dropped, and the watch removes (and kills) workers that
do not answer or make no step. The Ray-backed drills are in test_fault_drills.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from cluster.config import ClusterConfig
from cluster.global_scheduler import GoneReason, WorkerGone
from cluster.scheduler_actor import SchedulerService
from cluster.supervisor import ProgressWatch, Verdict
from scheduler.messages import (
    Claim,
    Dispatch,
    DispatchAnswer,
    GenerationSpec,
    HeldRequest,
    HeldStage,
    NoticeBatch,
    ReqEvent,
    SamplingSpec,
    SubmitBatch,
    WorkerEvent,
    WorkerHello,
    WorkerReport,
    WorkerSetup,
    decode,
)
from scheduler.request import RequestState


class FakeClient:
    """Workers that answer as told; records every call."""

    def __init__(self) -> None:
        self.handles: dict[str, Any] = {}
        self.calls: list[tuple[str, str, Any]] = []
        self.incarnations: dict[str, str] = {}
        self.ping_errors: dict[str, GoneReason] = {}
        self.dropped: dict[str, list[str]] = {}

    async def dispatch(self, worker_id: str, msg: Dispatch) -> DispatchAnswer:
        self.calls.append(("dispatch", worker_id, msg.spec.req_id))
        return DispatchAnswer(msg.spec.req_id, True, 100)

    async def preempt(self, worker_id: str, req_id: str, mode: str,
                      for_req_id: str | None, target_worker_id: str | None = None) -> bool:
        return True

    async def abort(self, worker_id: str, req_id: str) -> None:
        self.calls.append(("abort", worker_id, req_id))

    async def release_waiting(self, worker_id: str, prefill_worker_id: str,
                              req_ids: tuple[str, ...] | None) -> list[str]:
        self.calls.append(("release_waiting", worker_id, (prefill_worker_id, req_ids)))
        return self.dropped.get(worker_id, [])

    async def ping(self, worker_id: str) -> str:
        if worker_id in self.ping_errors:
            raise WorkerGone(worker_id, self.ping_errors[worker_id])
        return self.incarnations[worker_id]

    async def kill(self, worker_id: str) -> None:
        self.calls.append(("kill", worker_id, None))


def make_service(client: FakeClient, *, expected: tuple[str, ...] = ("p0", "d0"),
                 stall_s: float = 30.0) -> SchedulerService:
    cfg = ClusterConfig.from_dict({"pools": {"mode": "disaggregated"},
                                   "scheduling": {"worker_stall_timeout_s": stall_s}})
    return SchedulerService(cfg.resolve_presets(), expected, client=client)


def hello(wid: str, inc: str, held: tuple[HeldRequest, ...] = ()) -> WorkerHello:
    role = "decode" if wid.startswith("d") else "prefill"
    info = WorkerSetup(node="n", device="cpu", nvlink_domain="A", num_total_blocks=64,
                       num_free_blocks=64, bytes_per_block=4096, max_model_len=1024)
    return WorkerHello(wid, role, inc, info, held)


async def join(svc: SchedulerService, client: FakeClient, wid: str, inc: str,
               held: tuple[HeldRequest, ...] = ()) -> tuple[str, ...]:
    client.incarnations[wid] = inc
    return (await svc.register(hello(wid, inc, held), object())).drop_req_ids


def spec(rid: str, router: str = "router-1") -> GenerationSpec:
    return GenerationSpec(rid, tuple(range(40)), SamplingSpec(8, 0.0), 1, "t", time.time(),
                          router_id=router)


def held(rid: str, stage: HeldStage, prefill: str | None = None) -> HeldRequest:
    out = 0 if stage is HeldStage.RECEIVING else 3
    return HeldRequest(spec(rid), stage, 3, out, prefill, None if out == 0 else time.time())


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.005)


def test_a_new_incarnation_replaces_the_old_one_and_ends_what_it_held() -> None:
    async def go() -> None:
        client = FakeClient()
        svc = make_service(client)
        await join(svc, client, "p0", "p-1")
        await join(svc, client, "d0", "d-1")
        core = svc.core
        notices = core.notices("router-1")
        await anext(notices)
        core.submit_batch(SubmitBatch((spec("r"),)))
        await settle()
        assert core.core.get("r").state is RequestState.PREFILLING
        assert svc.report(WorkerReport("d0", 60, 64, incarnation="d-1"))
        # The process restarted: the new one registers, the old one's request is over.
        assert await join(svc, client, "d0", "d-2") == ()
        got = decode(await asyncio.wait_for(anext(notices), 2), NoticeBatch)
        assert [(n.req_id, n.error, n.retryable) for n in got.notices] == [
            ("r", "worker_failed", True)]
        assert not svc.report(WorkerReport("d0", 60, 64, incarnation="d-1"))  # stale
        assert svc.report(WorkerReport("d0", 64, 64, incarnation="d-2"))
        assert core.stats()["workers"]["d0"]["alive"]
        # A hello repeated (its answer lost) changes nothing.
        core.submit_batch(SubmitBatch((spec("s"),)))
        await settle()
        assert await join(svc, client, "d0", "d-2") == ()
        assert core.core.get("s") is not None
        await notices.aclose()
        await svc.close()

    asyncio.run(go())


def test_a_restarted_scheduler_adopts_the_workers_requests_and_settles_claims() -> None:
    async def go() -> None:
        client = FakeClient()
        svc = make_service(client)  # a fresh process: it has seen no worker yet
        drop = await join(svc, client, "d0", "d-1", (
            held("dec", HeldStage.DECODING), held("rcv", HeldStage.RECEIVING, "p0"),
            held("lost", HeldStage.RECEIVING, "p0")))
        assert drop == ()
        claim = asyncio.get_running_loop().create_task(
            svc.claim(Claim("router-1", ("dec", "rcv", "queued-there"))))
        await settle()
        assert not claim.done()  # waits until the expected workers are back
        # The prefill worker still computes "rcv"; "lost" it no longer has.
        client.dropped["d0"] = ["lost"]
        await join(svc, client, "p0", "p-1", (held("rcv", HeldStage.PREFILLING, "p0"),))
        answer = await asyncio.wait_for(claim, 2)
        assert answer.unknown_req_ids == ("queued-there",)  # the router retries it
        await settle()
        assert ("release_waiting", "d0", ("p0", ("lost",))) in client.calls
        core = svc.core.core
        assert core.get("lost") is None
        assert core.get("dec").state is RequestState.DECODING
        assert core.get("rcv").state is RequestState.PREFILLING
        svc.report(WorkerReport("d0", 50, 64, events=(
            ReqEvent("dec", WorkerEvent.FINISHED_LENGTH, time.time()),), incarnation="d-1"))
        assert core.get("dec") is None
        await svc.close()

    asyncio.run(go())


def test_a_worker_the_scheduler_gave_up_on_drops_what_it_holds_when_it_returns() -> None:
    async def go() -> None:
        client = FakeClient()
        svc = make_service(client)
        await join(svc, client, "p0", "p-1")
        await join(svc, client, "d0", "d-1")
        client.ping_errors["d0"] = GoneReason.TIMEOUT
        await svc._check_workers()
        await settle()
        assert ("kill", "d0", None) in client.calls
        # Not killed after all (the kill failed): it comes back as the same process.
        drop = await join(svc, client, "d0", "d-1", (held("old", HeldStage.DECODING),))
        assert drop == ("old",)
        assert svc.core.core.get("old") is None
        await svc.close()

    asyncio.run(go())


def test_the_watch_removes_restarting_workers_and_kills_hung_ones() -> None:
    async def go() -> None:
        client = FakeClient()
        svc = make_service(client, expected=("p0", "d0", "d1", "d2"), stall_s=0.05)
        await join(svc, client, "p0", "p-1")
        for wid in ("d0", "d1", "d2"):
            await join(svc, client, wid, f"{wid}-1")
        client.ping_errors["d0"] = GoneReason.RESTARTING  # Ray restarts it: no kill
        client.incarnations["d1"] = "d1-2"  # already restarted: no kill
        assert svc.report(WorkerReport("d2", 60, 64, num_steps=5, is_busy=True,
                                       incarnation="d2-1"))
        await asyncio.sleep(0.1)
        assert svc.report(WorkerReport("d2", 60, 64, num_steps=5, is_busy=True,
                                       incarnation="d2-1"))
        await svc._check_workers()  # d2: busy, and no step for longer than the bound
        assert svc.core.stats()["workers"]["d2"]["alive"]  # judged twice before it goes
        await svc._check_workers()
        await settle()
        workers = svc.core.stats()["workers"]
        assert [w for w in ("p0", "d0", "d1", "d2") if workers[w]["alive"]] == ["p0"]
        assert [c[1] for c in client.calls if c[0] == "kill"] == ["d2"]
        await svc.close()

    asyncio.run(go())


def test_a_worker_that_reports_itself_unhealthy_is_killed_for_ray_to_restart() -> None:
    """A decode worker whose KV listener is down for good (issue 24 item 2) steps on, idle
    or not; its report says so, and the watch replaces it as it does a hung one."""
    async def go() -> None:
        client = FakeClient()
        svc = make_service(client, expected=("p0", "d0", "d1"))
        for wid, inc in (("p0", "p-1"), ("d0", "d0-1"), ("d1", "d1-1")):
            await join(svc, client, wid, inc)
        assert svc.report(WorkerReport("d0", 60, 64, incarnation="d0-1", is_healthy=False))
        assert svc.report(WorkerReport("d1", 60, 64, incarnation="d1-1"))
        await svc._check_workers()
        assert svc.core.stats()["workers"]["d0"]["alive"]  # judged twice before it goes
        await svc._check_workers()
        await settle()
        workers = svc.core.stats()["workers"]
        assert [w for w in ("p0", "d0", "d1") if workers[w]["alive"]] == ["p0", "d1"]
        assert [c[1] for c in client.calls if c[0] == "kill"] == ["d0"]
        await svc.close()

    asyncio.run(go())


def test_a_dead_prefill_worker_ends_only_what_its_decode_worker_dropped() -> None:
    async def go() -> None:
        client = FakeClient()
        svc = make_service(client)
        await join(svc, client, "p0", "p-1")
        await join(svc, client, "d0", "d-1")
        core = svc.core
        core.submit_batch(SubmitBatch((spec("kv-arrived"), spec("kv-missing"))))
        await settle()
        client.dropped["d0"] = ["kv-missing"]
        client.ping_errors["p0"] = GoneReason.RESTARTING
        await svc._check_workers()
        await settle()
        assert ("release_waiting", "d0", ("p0", None)) in client.calls
        assert core.core.get("kv-missing") is None
        assert core.core.get("kv-arrived") is not None
        await svc.close()

    asyncio.run(go())


def test_progress_watch_judges_only_busy_workers() -> None:
    w = ProgressWatch(stall_s=10.0)
    w.watch("idle", "i", 0.0)
    w.watch("moving", "m", 0.0)
    w.watch("stuck", "s", 0.0)
    w.watch("silent", "q", 0.0)
    for t in (1.0, 6.0, 12.0):
        assert w.on_report("idle", "i", 3, False, t)
        assert w.on_report("moving", "m", int(t), True, t)
        assert w.on_report("stuck", "s", 7, True, t)
    assert w.on_report("silent", "q", 1, True, 1.0)
    assert not w.on_report("stuck", "other-incarnation", 8, True, 12.0)
    assert w.verdicts(12.5) == [("stuck", Verdict.STALLED), ("silent", Verdict.SILENT)]
    w.forget("stuck")
    assert w.verdicts(12.5) == [("silent", Verdict.SILENT)]
    assert w.on_report("idle", "i", 3, False, 13.0, is_healthy=False)
    assert w.verdicts(13.0) == [("idle", Verdict.UNHEALTHY), ("silent", Verdict.SILENT)]

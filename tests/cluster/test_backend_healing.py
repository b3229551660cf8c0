"""The router's cluster backend while the global scheduler restarts, over fake actor
handles (no Ray cluster): new requests get 503 with a Retry-After at once while the
scheduler is away, and after it returns the router claims its requests and retries those
the new scheduler does not know, from the tokens already streamed and without repeating
them. The Ray-backed drill (test_fault_drills.py) kills the real scheduler."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import ray

from cluster.backend import ClusterBackend
from cluster.messages import pack
from router.backend import BackendError, BackendErrorKind
from scheduler.messages import (
    AbortBatch,
    Claim,
    ClaimAnswer,
    GenerationSpec,
    NoticeBatch,
    SamplingSpec,
    SubmitAnswer,
    SubmitAnswers,
    SubmitBatch,
    SubmitOutcome,
    TokenBatch,
    TokenDelta,
    decode,
    encode,
)


async def _value(v: Any) -> Any:
    return v


class Method:
    """An actor method: ``.options(...).remote(*args)`` calls ``fn``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def options(self, **_: Any) -> Method:
        return self

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


def _gone() -> Exception:
    return ray.exceptions.ActorUnavailableError("restarting", None)


class FakeScheduler:
    def __init__(self) -> None:
        self.submitted: list[GenerationSpec] = []
        self.claims: list[Claim] = []
        self.unknown: tuple[str, ...] = ()
        self.claim_failures = 0  # claims that fail before one gets through
        self.is_up = True
        self.notice_streams = 0
        self.num_submit_calls = 0
        self._break = asyncio.Event()
        self.submit = Method(self._submit)
        self.notices = Method(self._notices)
        self.claim = Method(self._claim)
        self.finish = Method(lambda _: _value(None))
        self.abort = Method(lambda _: _value(None))
        self.worker_failed = Method(lambda _: _value(None))
        self.health = Method(self._health)
        self.num_health_calls = 0

    async def _health(self) -> bytes:
        self.num_health_calls += 1
        if not self.is_up:
            raise _gone()
        return pack({"ready": True, "policy": "tierserve", "mode": "disaggregated",
                     "live_workers": {"prefill": 1, "decode": 1}})

    async def _submit(self, raw: bytes) -> bytes:
        self.num_submit_calls += 1
        if not self.is_up:
            raise _gone()
        specs = decode(raw, SubmitBatch).specs
        self.submitted.extend(specs)
        return encode(SubmitAnswers(tuple(SubmitAnswer(s.req_id, SubmitOutcome.ACCEPTED)
                                          for s in specs)))

    async def _notices(self, router_id: str) -> AsyncIterator[Any]:
        if not self.is_up:
            raise _gone()
        self.notice_streams += 1
        yield _value(encode(NoticeBatch(())))
        await self._break.wait()
        self._break.clear()
        raise _gone()

    async def _claim(self, raw: bytes) -> bytes:
        self.claims.append(decode(raw, Claim))
        if self.claim_failures > 0:
            self.claim_failures -= 1
            raise _gone()
        return encode(ClaimAnswer(self.unknown))

    def crash(self) -> None:
        self.is_up = False
        self._break.set()


class FakeDecode:
    """One decode worker: the test pushes token batches to the router's stream."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.subscribe = Method(self._subscribe)

    async def _subscribe(self, router_id: str) -> AsyncIterator[Any]:
        while True:
            yield _value(await self.queue.get())

    def send(self, req_id: str, tokens: tuple[int, ...], finish: str | None = None) -> None:
        self.queue.put_nowait(encode(TokenBatch("d0", (TokenDelta(req_id, tokens, finish),))))


class ByteTokens:
    def decode(self, ids: Any) -> str:
        return ""


def make_backend() -> tuple[ClusterBackend, FakeScheduler, FakeDecode]:
    sched, dec = FakeScheduler(), FakeDecode()
    return ClusterBackend(sched, {"d0": dec}, ByteTokens(), "m", 1024, 2.0, 60.0), sched, dec


def spec(rid: str) -> GenerationSpec:
    return GenerationSpec(rid, (1, 2, 3), SamplingSpec(6, 0.0), 1, "t", time.time())


async def wait_for(cond: Callable[[], bool]) -> None:
    for _ in range(400):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_while_the_scheduler_is_away_new_requests_get_503_with_retry_after() -> None:
    async def go() -> None:
        backend, sched, dec = make_backend()
        assert (await backend.health())["ok"] is True
        await wait_for(lambda: sched.notice_streams == 1)
        sched.crash()
        await asyncio.sleep(0.05)
        with pytest.raises(BackendError) as e:
            await anext(backend.generate(spec("a")))
        assert e.value.kind is BackendErrorKind.UNAVAILABLE and e.value.retry_after_s
        assert (await backend.health())["ok"] is False
        assert sched.num_submit_calls == 0  # refused without any RPC
        sched.is_up = True  # it is back: the router's notice stream opens again
        await wait_for(lambda: sched.notice_streams == 2)
        assert (await backend.health())["ok"] is True
        stream = backend.generate(spec("b"))
        first = asyncio.get_running_loop().create_task(anext(stream))
        await wait_for(lambda: len(sched.submitted) == 1)
        dec.send("b", (5,), "stop")
        assert (await first).finish is not None
        await stream.aclose()

    asyncio.run(go())


def test_requests_the_restarted_scheduler_lost_are_retried_without_repeating_tokens() -> None:
    async def go() -> None:
        backend, sched, dec = make_backend()
        stream = backend.generate(spec("a"))
        first = asyncio.get_running_loop().create_task(anext(stream))
        await wait_for(lambda: len(sched.submitted) == 1)
        dec.send("a", (7, 8))
        assert (await first).token_ids == (7, 8)
        # The scheduler restarts without "a" (it was queued there, say): the router claims
        # it when the notice stream opens again, hears it is unknown, and retries it.
        sched.unknown = ("a",)
        sched.crash()
        await asyncio.sleep(0.05)
        sched.is_up = True
        nxt = asyncio.get_running_loop().create_task(anext(stream))
        await wait_for(lambda: len(sched.submitted) == 2)
        assert sched.claims and sched.claims[0].req_ids == ("a",)
        retry = sched.submitted[1]
        assert retry.req_id == "a-r1"
        assert retry.prompt_token_ids == (1, 2, 3, 7, 8)  # recompute from what was streamed
        assert retry.sampling.max_tokens == 4
        dec.send("a-r1", (9, 10, 11, 12), "length")
        delta = await nxt
        assert delta.token_ids == (9, 10, 11, 12) and delta.finish is not None
        await stream.aclose()

    asyncio.run(go())


def make_bounded_backend(resume_s: float) -> tuple[ClusterBackend, FakeScheduler, FakeDecode]:
    sched, dec = FakeScheduler(), FakeDecode()
    aborted: list[str] = []
    sched.aborted = aborted  # type: ignore[attr-defined]

    async def abort(raw: bytes) -> None:
        aborted.extend(decode(raw, AbortBatch).req_ids)

    sched.abort = Method(abort)
    return (ClusterBackend(sched, {"d0": dec}, ByteTokens(), "m", 1024, 2.0, 60.0,
                           retry_resume_s=resume_s), sched, dec)


def test_a_retry_that_does_not_resume_within_the_bound_ends_with_a_clear_error() -> None:
    async def go() -> None:
        backend, sched, dec = make_bounded_backend(0.3)
        stream = backend.generate(spec("a"))
        first = asyncio.get_running_loop().create_task(anext(stream))
        await wait_for(lambda: len(sched.submitted) == 1)
        dec.send("a", (7,))
        assert (await first).token_ids == (7,)
        nxt = asyncio.get_running_loop().create_task(anext(stream))
        dec.queue.put_nowait(encode(TokenBatch("d0", (TokenDelta("a", (), error="worker_failed"),))))
        await wait_for(lambda: len(sched.submitted) == 2)  # retried from the streamed token
        assert sched.submitted[1].prompt_token_ids == (1, 2, 3, 7)
        with pytest.raises(BackendError) as e:  # the retry streams nothing: a clear end
            await nxt
        assert e.value.kind is BackendErrorKind.UNAVAILABLE and e.value.retry_after_s
        assert "did not resume within 0.3 s" in str(e.value)
        assert sched.aborted == ["a-r1"]  # the silent attempt is not left in the cluster

    asyncio.run(go())


def test_a_retry_that_resumes_within_the_bound_streams_on() -> None:
    async def go() -> None:
        backend, sched, dec = make_bounded_backend(5.0)
        stream = backend.generate(spec("a"))
        first = asyncio.get_running_loop().create_task(anext(stream))
        await wait_for(lambda: len(sched.submitted) == 1)
        dec.queue.put_nowait(encode(TokenBatch("d0", (TokenDelta("a", (), error="worker_failed"),))))
        await wait_for(lambda: len(sched.submitted) == 2)
        dec.send("a-r1", (4, 5))
        assert (await first).token_ids == (4, 5)
        dec.send("a-r1", (6,), "length")
        assert (await anext(stream)).finish is not None
        assert sched.aborted == []
        await stream.aclose()

    asyncio.run(go())


def test_a_retry_admission_turns_away_for_now_is_submitted_again() -> None:
    async def go() -> None:
        backend, sched, dec = make_bounded_backend(5.0)
        refusals = [1]  # the first retry finds no SLO headroom; the next look finds room
        inner = sched.submit.fn

        async def submit(raw: bytes) -> bytes:
            specs = decode(raw, SubmitBatch).specs
            if specs[0].req_id.endswith("-r1") and refusals:
                refusals.pop()
                return encode(SubmitAnswers(tuple(SubmitAnswer(
                    s.req_id, SubmitOutcome.REJECTED, "no_slo_headroom", 0.1) for s in specs)))
            return await inner(raw)

        sched.submit = Method(submit)
        stream = backend.generate(spec("a"))
        first = asyncio.get_running_loop().create_task(anext(stream))
        await wait_for(lambda: len(sched.submitted) == 1)
        dec.queue.put_nowait(encode(TokenBatch("d0", (TokenDelta("a", (), error="worker_failed"),))))
        await wait_for(lambda: len(sched.submitted) == 2)  # accepted at the second look
        assert not refusals
        dec.send("a-r1", (4, 5), "length")
        assert (await first).token_ids == (4, 5)
        await stream.aclose()

    asyncio.run(go())


def test_a_flood_of_health_probes_costs_the_scheduler_one_small_call(monkeypatch) -> None:
    """Issue 24 item 6: /health is unauthenticated; each probe used to build the
    scheduler's full stats. Probes now share one light call per HEALTH_CACHE_S."""
    import cluster.backend as backend_mod

    async def go() -> None:
        backend, sched, _ = make_backend()
        got = await asyncio.gather(*(backend.health() for _ in range(200)))
        assert all(g["ok"] for g in got) and sched.num_health_calls == 1
        for _ in range(50):
            await backend.health()
        assert sched.num_health_calls == 1
        monkeypatch.setattr(backend_mod, "HEALTH_CACHE_S", 0.0)
        await asyncio.sleep(0.01)
        await backend.health()
        assert sched.num_health_calls == 2  # older than the bound: asked again

    asyncio.run(go())


@pytest.mark.parametrize("failures", [2, 99])
def test_a_claim_that_fails_is_tried_again_then_its_requests_retried(monkeypatch,
                                                                    failures: int) -> None:
    """Issue 24 item 5: a claim that failed once was dropped, and a request the restarted
    scheduler did not know waited out request_timeout_s (600 s). Now: tried again with
    backoff; if every try fails, the requests it named are retried."""
    import cluster.backend as backend_mod

    monkeypatch.setattr(backend_mod, "CLAIM_BACKOFF_S", (0.01, 0.01, 0.01))

    async def go() -> None:
        backend, sched, dec = make_backend()
        stream = backend.generate(spec("a"))
        first = asyncio.get_running_loop().create_task(anext(stream))
        await wait_for(lambda: len(sched.submitted) == 1)
        dec.send("a", (7,))
        await first
        sched.unknown = ("a",)  # lost with the scheduler
        sched.claim_failures = failures
        sched.crash()
        await asyncio.sleep(0.05)
        sched.is_up = True
        nxt = asyncio.get_running_loop().create_task(anext(stream))
        await wait_for(lambda: len(sched.submitted) == 2)  # retried, well within 600 s
        assert len(sched.claims) == min(failures + 1, 4)
        assert sched.submitted[1].req_id == "a-r1"
        dec.send("a-r1", (9,), "stop")
        assert (await nxt).finish is not None
        await stream.aclose()

    asyncio.run(go())

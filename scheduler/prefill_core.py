"""One prefill worker's requests, decided in one pure object: :class:`PrefillCore`.

The prefill worker's counterpart of :class:`~scheduler.worker_core.DecodeCore`: its job
table (one :class:`PrefillStage` per request, every move through ``_move``), its step
planner, and what it reports. The live prefill worker (``prefill_pool/worker.py``)
applies the answers to its engine, its KV producer and the decode workers' RPC.

Life of a request on a prefill worker::

    start ──▶ PREFILLING ──(its last chunk ran: first token out)──▶ SENDING ──(transfer
                 │  (every chunk's finished blocks are pushed at once)     ended)──▶ (released)
                 └──(abort, a failed step, the engine refused it)──▶ (gone)

PREFILLING: queued or between chunks, as the policy picks its chunks (its transfer is
kept alive every turn: the policy may hold a lower tier longer than a transfer's
timeouts). SENDING: its first token went to the decode worker (PREFILL_DONE reported,
with when it reached the worker and when its first chunk began); its blocks stay until
the transfer is terminal, then go back (full ones stay in the prefix cache).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduler.messages import (
    BlockEvent,
    GenerationSpec,
    HeldRequest,
    HeldStage,
    KVMemoryReport,
    Prefilled,
    ReqEvent,
    RunningReq,
    TokenDelta,
    WorkerEvent,
    WorkerReport,
)
from scheduler.request import Request, RequestState
from scheduler.step_planner import StepPlan, WorkerScheduler
from scheduler.worker_core import MAX_UNREPORTED


class PrefillStage(enum.Enum):
    PREFILLING = "prefilling"
    SENDING = "sending"  # prefilled; its KV still on the wire to the decode worker
    ENDED = "ended"


_MOVES: dict[PrefillStage | None, frozenset[PrefillStage]] = {
    None: frozenset({PrefillStage.PREFILLING}),
    PrefillStage.PREFILLING: frozenset({PrefillStage.SENDING, PrefillStage.ENDED}),
    PrefillStage.SENDING: frozenset({PrefillStage.ENDED}),
    PrefillStage.ENDED: frozenset(),
}


# The kernel state each stage stands for (the planner's orderings read it).
_REQUEST_STATE = {PrefillStage.PREFILLING: RequestState.PREFILLING,
                  PrefillStage.SENDING: RequestState.TRANSFERRING}


@dataclass(slots=True)
class Job:
    spec: GenerationSpec | None  # None in the simulator (no tokens there)
    decode_worker_id: str
    req: Request
    received: float  # when it reached this worker
    started: float = 0.0  # when the step that ran its first chunk began
    stage: PrefillStage | None = None
    history: list[tuple[float, PrefillStage, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PrefillOutput:
    """One sequence's outcome of a prefill step, as the engine saw it."""

    req_id: str
    ready_block_ids: tuple[int, ...] = ()  # blocks this chunk finished: send them now
    prefill_done: bool = False
    first_token: int = 0
    finish: str | None = None  # the first token was also the last ("stop" | "length")
    delta: TokenDelta | None = None  # the first token as the router gets it
    error: str | None = None  # the step failed on this request alone (it left the engine)


@dataclass(slots=True)
class StepOutcome:
    """What a step's outputs ask of the mechanism."""

    pushes: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    firsts: dict[str, list[Prefilled]] = field(default_factory=dict)  # per decode worker
    dropped: list[str] = field(default_factory=list)  # failed alone: stop their transfer


class PrefillCore:
    def __init__(self, worker_id: str, planner: WorkerScheduler) -> None:
        self.worker_id = worker_id
        self.planner = planner
        self.jobs: dict[str, Job] = {}
        self.events: list[ReqEvent] = []
        self.block_events: list[BlockEvent] = []
        self._protected: frozenset[int] = frozenset()
        self.num_steps = 0
        self.step_seconds = 0.0  # in steps since the process started (WorkerReport)
        self.plan_was_empty = False

    def _move(self, job: Job, to: PrefillStage, why: str, now: float) -> None:
        if to not in _MOVES[job.stage]:
            raise ValueError(f"{job.req.req_id}: {job.stage} -> {to.value} ({why})")
        job.stage = to
        job.history.append((now, to, why))
        if to is PrefillStage.ENDED:
            self.jobs.pop(job.req.req_id, None)
            return
        self.jobs[job.req.req_id] = job
        job.req.state = _REQUEST_STATE[to]

    def ids(self, stage: PrefillStage) -> list[str]:
        return [rid for rid, j in self.jobs.items() if j.stage is stage]

    def is_sending(self) -> bool:
        return any(j.stage is PrefillStage.SENDING for j in self.jobs.values())

    # -- requests ------------------------------------------------------------------------

    def start(self, spec: GenerationSpec | None, req: Request, decode_worker_id: str,
              now: float, *, num_cached_tokens: int = 0) -> str | None:
        """Queue ``req``'s prefill (its KV goes to ``decode_worker_id``; the first
        ``num_cached_tokens`` of it known cached); None, or why not."""
        if req.req_id in self.jobs:
            return "invalid: duplicate request id"
        self._move(Job(spec, decode_worker_id, req, now), PrefillStage.PREFILLING, "start", now)
        self.planner.add_prefill(req, req.prompt_len - num_cached_tokens, now,
                                 num_computed=num_cached_tokens)
        return None

    def end(self, req_id: str, why: str, now: float) -> Job | None:
        """The request leaves (aborted, refused by the engine, sent); its job, if it was here."""
        job = self.jobs.get(req_id)
        if job is None:
            return None
        self.planner.remove(req_id)
        self._move(job, PrefillStage.ENDED, why, now)
        return job

    def fail(self, req_id: str, error: str, now: float) -> tuple[str, Prefilled] | None:
        """End ``req_id`` here; its decode worker and the error it tells the client."""
        job = self.end(req_id, "failed", now)
        if job is None:
            return None
        return job.decode_worker_id, Prefilled(req_id, 0, None, now, error)

    # -- steps ---------------------------------------------------------------------------

    def plan(self, now: float, num_free_blocks: int) -> StepPlan:
        plan = self.planner.plan(now, num_free_blocks)
        self.plan_was_empty = not plan.chunks
        return plan

    def began(self, plan: StepPlan, began: float) -> None:
        for rid, _ in plan.chunks:
            job = self.jobs.get(rid)
            if job is not None and not job.started:
                job.started = began

    def protect(self) -> frozenset[int] | None:
        """The prefix hashes of the requests waiting here to start (as the policy names
        them), when they changed since the last step."""
        waiting = [r for r in self.planner.queue.requests() if r.num_computed_tokens == 0]
        hashes = frozenset(self.planner.policy.protected_hashes(waiting))
        if hashes == self._protected:
            return None
        self._protected = hashes
        return hashes

    def step_ran(self, plan: StepPlan, now: float, *, seconds: float | None,
                 outputs: Iterable[PrefillOutput], refused: list[str], blocks: dict[str, int],
                 computed: dict[str, int], t: float) -> StepOutcome:
        """The engine ran ``plan``; ``t``: when its outputs are out."""
        outputs = list(outputs)
        self.step_seconds += seconds or 0.0
        if any(o.error is not None for o in outputs):
            seconds = None  # the step ran twice (batched, then one by one): not a cost sample
        # The blocks too: a started prompt holds all of its blocks, and a planner that is
        # not told asks for them again before each of its next chunks.
        self.planner.commit(plan, now, seconds=seconds, refused=refused, blocks=blocks,
                            computed=computed, decodes_here=False)
        self.num_steps += 1
        return self.outputs(outputs, t)

    def outputs(self, outputs: Iterable[PrefillOutput], t: float) -> StepOutcome:
        """A committed step's outputs: what to send, to whom, and what to stop sending."""
        out = StepOutcome()
        seqs: dict[str, list[PrefillOutput]] = {}
        for o in outputs:
            job = self.jobs.get(o.req_id)
            if job is None or job.stage is not PrefillStage.PREFILLING:
                continue
            if o.error is not None:
                self.end(o.req_id, "step_failed", t)
                out.dropped.append(o.req_id)
                out.firsts.setdefault(job.decode_worker_id, []).append(
                    Prefilled(o.req_id, 0, None, t, f"step_failed: {o.error}"))
                continue
            if o.ready_block_ids:
                out.pushes.append((o.req_id, o.ready_block_ids))
            if o.prefill_done:
                seqs.setdefault(o.req_id, []).append(o)
        for rid, done in seqs.items():
            job = self.jobs[rid]
            self.planner.remove(rid)
            self._move(job, PrefillStage.SENDING, "prefill_done", t)
            head = done[0]
            n = job.spec.sampling.n if job.spec is not None else 1
            finish = head.finish if n == 1 else None
            out.firsts.setdefault(job.decode_worker_id, []).append(Prefilled(
                rid, head.first_token, finish, t,
                deltas=tuple(o.delta for o in done if o.delta is not None)))
            self.events.append(ReqEvent(rid, WorkerEvent.PREFILL_DONE, t,
                                        received=job.received, started=job.started))
        return out

    # -- reports -------------------------------------------------------------------------

    def held(self) -> tuple[HeldRequest, ...]:
        local = self.planner.local
        return tuple(HeldRequest(j.spec, HeldStage.PREFILLING, 0, 0, self.worker_id,
                                 num_prefill_left=local[rid].num_prefill_left
                                 if rid in local else 0)
                     for rid, j in self.jobs.items() if j.spec is not None)

    def report(self, num_free_blocks: int, num_total_blocks: int, memory: KVMemoryReport
               ) -> WorkerReport:
        local = self.planner.local
        running = tuple(RunningReq(rid, 0, 0, local[rid].num_prefill_left if rid in local else 0)
                        for rid, j in self.jobs.items() if j.stage is PrefillStage.PREFILLING)
        return WorkerReport(self.worker_id, num_free_blocks, num_total_blocks,
                            tuple(self.events), tuple(self.block_events), (), running,
                            self.planner.costs.to_tuple(), self.num_steps,
                            is_busy=self.planner.has_work() and not self.plan_was_empty,
                            memory=memory, step_seconds=self.step_seconds)

    def delivered(self, rep: WorkerReport, ok: bool) -> None:
        """The events stay until a report carried them: a PREFILL_DONE lost here would
        leave the prefill in the scheduler's book of this worker's queued work."""
        for book, sent in ((self.events, rep.events), (self.block_events, rep.block_events)):
            del book[:len(sent) if ok else -MAX_UNREPORTED]


__all__ = ["Job", "PrefillCore", "PrefillOutput", "PrefillStage", "StepOutcome"]

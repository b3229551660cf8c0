"""Why was this request late: a request's causal chain in plain words (issue 6 item 4).

Data flow: the global scheduler keeps, per request, its ``DecisionRecord`` history, its
workers and its KV transfers. It turns them into a :class:`RequestLog` (msgpack/JSON-able,
``RequestLog.from_request(req, transfers=...)`` takes a ``scheduler.request.Request``)
and keeps a bounded window of them. ``GET /v1/requests/{id}/why`` and ``tierserve why``
call :func:`explain` on that window::

    explain("X", logs, tiers) -> WhyReport
        .steps: [WhyStep(kind=QUEUED, ...), WhyStep(kind=KV_FULL, ...),
                 WhyStep(kind=PREEMPTED_OTHER, ...), WhyStep(kind=TRANSFER, ...), ...]
        .text:  "tier-0 request X waited 420 ms: KV full on decode-1; preempted tier-3
                 request Y (swap, 80 ms); transfer crossed NVLink domains (30 ms); ..."
        .to_dict() / WhyReport.from_dict(d)   (the HTTP answer's JSON)

Who blocked whom comes from ``blocking_req_id``: a victim's preemption record names the
request it was preempted for, and a waiting request's record may name the request it
waited on. :func:`phases` cuts a log into queue / prefill / transfer / decode / preemption
intervals; the tracer (cluster/tracing.py) builds its spans from the same phases.

Record times are seconds on one clock (the global scheduler's); only differences are
shown here.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from scheduler.request import Decision, DecisionRecord, RequestState
from scheduler.tiers import TierConfig

# KV use at or above this on the deciding worker reads as "KV full".
KV_FULL_PRESSURE = 0.95

TOPOLOGY_WORDS = {
    "same_device": "transfer stayed on one device",
    "same_domain": "transfer stayed inside an NVLink domain",
    "same_node": "transfer crossed NVLink domains",
    "cross_node": "transfer crossed nodes",
}

# The preemption decisions and the mode each names.
PREEMPT_MODES = {
    Decision.PREEMPT_SWAP: "swap",
    Decision.PREEMPT_RECOMPUTE: "recompute",
    Decision.PREEMPT_MIGRATE: "migrate",
}
_RESUME_WORDS = {
    Decision.RESUME_SWAP_IN: "resumed by swap-in",
    Decision.RESUME_RECOMPUTE: "resumed by recompute",
    Decision.RESUME_MIGRATE: "resumed by migration",
}


@dataclass(frozen=True, slots=True)
class TransferInfo:
    """One KV transfer of a request, prefill worker to decode worker."""

    topology_class: str  # a scheduler/cluster TopologyClass value: same_device ... cross_node
    num_bytes: int
    seconds: float
    src_worker_id: str
    dst_worker_id: str
    start_time: float

    def to_dict(self) -> dict[str, Any]:
        return {"topology_class": self.topology_class, "num_bytes": self.num_bytes,
                "seconds": self.seconds, "src_worker_id": self.src_worker_id,
                "dst_worker_id": self.dst_worker_id, "start_time": self.start_time}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TransferInfo:
        return cls(topology_class=str(d["topology_class"]), num_bytes=int(d["num_bytes"]),
                   seconds=float(d["seconds"]), src_worker_id=str(d["src_worker_id"]),
                   dst_worker_id=str(d["dst_worker_id"]), start_time=float(d["start_time"]))


class RequestLike(Protocol):
    """What :meth:`RequestLog.from_request` reads; ``scheduler.request.Request`` fits."""

    req_id: str
    tier: int
    arrival_time: float
    prompt_len: int
    num_output_tokens: int
    first_token_time: float | None
    finish_time: float | None
    prefill_worker_id: str | None
    decode_worker_id: str | None
    history: list[DecisionRecord]


@dataclass(frozen=True, slots=True)
class RequestLog:
    """Everything known about one request's life, in plain types."""

    req_id: str
    tier: int
    arrival_time: float
    records: tuple[DecisionRecord, ...]
    prompt_len: int = 0
    num_output_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_worker_id: str | None = None
    decode_worker_id: str | None = None
    transfers: tuple[TransferInfo, ...] = ()
    tenant: str = ""  # whose request it is: /why shows a tenant its own requests only

    @classmethod
    def from_request(cls, req: RequestLike, transfers: Iterable[TransferInfo] = (),
                     tenant: str = "") -> RequestLog:
        return cls(req_id=req.req_id, tier=req.tier, arrival_time=req.arrival_time, tenant=tenant,
                   records=tuple(req.history), prompt_len=req.prompt_len,
                   num_output_tokens=req.num_output_tokens,
                   first_token_time=req.first_token_time, finish_time=req.finish_time,
                   prefill_worker_id=req.prefill_worker_id,
                   decode_worker_id=req.decode_worker_id, transfers=tuple(transfers))

    def to_dict(self) -> dict[str, Any]:
        return {"req_id": self.req_id, "tier": self.tier, "arrival_time": self.arrival_time,
                "records": [r.to_dict() for r in self.records], "prompt_len": self.prompt_len,
                "num_output_tokens": self.num_output_tokens,
                "first_token_time": self.first_token_time, "finish_time": self.finish_time,
                "prefill_worker_id": self.prefill_worker_id,
                "decode_worker_id": self.decode_worker_id,
                "transfers": [t.to_dict() for t in self.transfers], "tenant": self.tenant}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestLog:
        def opt_float(key: str) -> float | None:
            return None if d.get(key) is None else float(d[key])

        def opt_str(key: str) -> str | None:
            return None if d.get(key) is None else str(d[key])

        return cls(req_id=str(d["req_id"]), tier=int(d["tier"]),
                   arrival_time=float(d["arrival_time"]),
                   records=tuple(DecisionRecord.from_dict(r) for r in d.get("records", ())),
                   prompt_len=int(d.get("prompt_len", 0)),
                   num_output_tokens=int(d.get("num_output_tokens", 0)),
                   first_token_time=opt_float("first_token_time"),
                   finish_time=opt_float("finish_time"),
                   prefill_worker_id=opt_str("prefill_worker_id"),
                   decode_worker_id=opt_str("decode_worker_id"),
                   transfers=tuple(TransferInfo.from_dict(t) for t in d.get("transfers", ())),
                   tenant=str(d.get("tenant", "")))


# -- phases ------------------------------------------------------------------------------


class PhaseKind(enum.Enum):
    QUEUE = "queue"
    PREFILL = "prefill"
    TRANSFER = "transfer"
    DECODE = "decode"
    PREEMPTION = "preemption"


_STATE_PHASE = {
    RequestState.QUEUED: PhaseKind.QUEUE,
    RequestState.PREFILLING: PhaseKind.PREFILL,
    RequestState.TRANSFERRING: PhaseKind.TRANSFER,
    RequestState.DECODING: PhaseKind.DECODE,
    RequestState.PREEMPTING: PhaseKind.PREEMPTION,
    RequestState.PREEMPTED: PhaseKind.PREEMPTION,
}


@dataclass(frozen=True, slots=True)
class Phase:
    """An interval a request spent in one phase; ``records`` are the decisions inside it,
    the first being the one that opened it (none for the initial queue)."""

    kind: PhaseKind
    start: float
    end: float
    records: tuple[DecisionRecord, ...]

    @property
    def duration_s(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def opened_by(self) -> DecisionRecord | None:
        return self.records[0] if self.records else None


def phases(log: RequestLog, now: float | None = None) -> list[Phase]:
    """Cut the log into phases; consecutive states of one kind merge (PREEMPTING +
    PREEMPTED is one preemption). A live request's last phase ends at ``now`` (or at
    its last record when ``now`` is not given)."""
    records = sorted(log.records, key=lambda r: r.time)
    out: list[Phase] = []
    kind = _STATE_PHASE.get(records[0].from_state) if records else PhaseKind.QUEUE
    start = log.arrival_time
    inside: list[DecisionRecord] = []
    for rec in records:
        nxt = _STATE_PHASE.get(rec.to_state)
        if nxt is kind:
            inside.append(rec)
            continue
        if kind is not None:
            out.append(Phase(kind, start, max(start, rec.time), tuple(inside)))
        kind, start, inside = nxt, rec.time, [rec]
    if kind is not None:
        end = log.finish_time if log.finish_time is not None else now
        end = start if end is None else max(start, end)
        out.append(Phase(kind, start, end, tuple(inside)))
    return out


# -- the report --------------------------------------------------------------------------


class StepKind(enum.Enum):
    QUEUED = "queued"  # time waiting before (or between) prefills
    KV_FULL = "kv_full"  # the deciding worker's KV was (nearly) full
    WAITED_ON = "waited_on"  # a record names another request this one waited on
    PREEMPTED_OTHER = "preempted_other"  # another request was preempted for this one
    PREEMPTED = "preempted"  # this request was preempted
    PREFILL = "prefill"
    TRANSFER = "transfer"
    DECODE = "decode"
    ENDED = "ended"  # rejected, aborted or still running
    VERDICT = "verdict"  # targets met or missed


@dataclass(frozen=True, slots=True)
class WhyStep:
    kind: StepKind
    text: str
    duration_s: float | None = None
    other_req_id: str | None = None
    worker_id: str | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "text": self.text, "duration_s": self.duration_s,
                "other_req_id": self.other_req_id, "worker_id": self.worker_id,
                "detail": dict(self.detail)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WhyStep:
        return cls(kind=StepKind(d["kind"]), text=str(d["text"]),
                   duration_s=None if d.get("duration_s") is None else float(d["duration_s"]),
                   other_req_id=d.get("other_req_id"), worker_id=d.get("worker_id"),
                   detail=dict(d.get("detail") or {}))


@dataclass(frozen=True, slots=True)
class WhyReport:
    req_id: str
    tier: int
    state: str
    waited_s: float
    ttft_s: float | None
    e2e_s: float | None
    late: bool | None  # None: still running and not yet late
    steps: tuple[WhyStep, ...]
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"req_id": self.req_id, "tier": self.tier, "state": self.state,
                "waited_s": self.waited_s, "ttft_s": self.ttft_s, "e2e_s": self.e2e_s,
                "late": self.late, "steps": [s.to_dict() for s in self.steps], "text": self.text}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WhyReport:
        def opt(key: str) -> float | None:
            return None if d.get(key) is None else float(d[key])

        return cls(req_id=str(d["req_id"]), tier=int(d["tier"]), state=str(d["state"]),
                   waited_s=float(d["waited_s"]), ttft_s=opt("ttft_s"), e2e_s=opt("e2e_s"),
                   late=d.get("late"), steps=tuple(WhyStep.from_dict(s) for s in d["steps"]),
                   text=str(d["text"]))


def ms(seconds: float) -> str:
    """420 ms, 1.25 s, 3 min: the unit a person reads at a glance."""
    if seconds < 1.0:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120.0:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.3g} min"


def _tier_label(tier: int) -> str:
    return f"tier-{tier}"


def _worker_in(triggered_by: str, candidates: Iterable[str | None]) -> str | None:
    for w in candidates:
        if w and w in triggered_by:
            return w
    return None


def explain(
    req_id: str,
    logs: Mapping[str, RequestLog],
    tiers: TierConfig,
    *,
    now: float | None = None,
    viewer: str | None = None,
) -> WhyReport | None:
    """The causal chain of ``req_id``; ``None`` when ``logs`` do not know the request.

    ``logs`` maps req_id to :class:`RequestLog` for the request and the ones around it
    (those it was preempted for, those preempted for it); unknown others are named
    without their tier. ``viewer`` (a tenant name): ``None`` unless the request is that
    tenant's, and the chain names no request of another tenant (nor an unknown one): it
    says "a request of another tenant" and leaves ``other_req_id`` empty.
    """
    log = logs.get(req_id)
    if log is None or (viewer is not None and log.tenant != viewer):
        return None
    if not 0 <= log.tier < tiers.num_tiers:
        raise ValueError(f"request {req_id}: tier {log.tier} is not configured")
    spec = tiers[log.tier]
    parts = phases(log, now)
    steps: list[WhyStep] = []
    workers = (log.decode_worker_id, log.prefill_worker_id)

    def hidden(other: str | None) -> bool:
        if viewer is None or other is None:
            return False
        o = logs.get(other)
        return o is None or o.tenant != viewer

    def name(other: str) -> str:
        o = logs.get(other)
        if hidden(other):
            tier = f"{_tier_label(o.tier)} " if o else ""
            return f"a {tier}request of another tenant"
        return f"{_tier_label(o.tier)} request {other}" if o else f"request {other}"

    def shown(other: str | None) -> str | None:
        return None if hidden(other) else other

    # 1. Waiting: every queue phase, and what held it there.
    queue_phases = [p for p in parts if p.kind is PhaseKind.QUEUE]
    waited = sum(p.duration_s for p in queue_phases)
    if queue_phases:
        steps.append(WhyStep(StepKind.QUEUED, f"waited {ms(waited)}", waited,
                             detail={"num_queue_phases": len(queue_phases)}))
    seen_blockers: set[object] = set()
    for rec in sorted(log.records, key=lambda r: r.time):
        if rec.from_state is not RequestState.QUEUED and rec.decision not in (
            Decision.SCHEDULE_PREFILL, Decision.ADMIT, Decision.REJECT
        ):
            continue
        worker = _worker_in(rec.triggered_by, workers) or log.decode_worker_id
        if rec.mem_pressure >= KV_FULL_PRESSURE and ("kv_full", worker) not in seen_blockers:
            seen_blockers.add(("kv_full", worker))
            where = f" on {worker}" if worker else ""
            steps.append(WhyStep(StepKind.KV_FULL, f"KV full{where}", worker_id=worker,
                                 detail={"mem_pressure": rec.mem_pressure,
                                         "triggered_by": rec.triggered_by}))
        if rec.blocking_req_id and rec.blocking_req_id not in seen_blockers:
            if not _was_preempted_for(logs, rec.blocking_req_id, req_id):
                seen_blockers.add(rec.blocking_req_id)
                steps.append(WhyStep(StepKind.WAITED_ON,
                                     f"waited on {name(rec.blocking_req_id)}",
                                     other_req_id=shown(rec.blocking_req_id),
                                     detail={"triggered_by": rec.triggered_by}))

    # 2. Requests preempted to make room for this one.
    for other in logs.values():
        # Cheap test first: the window may hold tens of thousands of logs.
        if other.req_id == req_id or not any(r.blocking_req_id == req_id for r in other.records):
            continue
        for p in phases(other, now):
            first = p.opened_by
            if p.kind is not PhaseKind.PREEMPTION or first is None:
                continue
            if first.blocking_req_id != req_id:
                continue
            mode = PREEMPT_MODES.get(first.decision, first.decision.value)
            freed = _freeing_time(p)
            figure = f", {ms(freed)}" if freed >= 0.0005 else ""
            steps.append(WhyStep(StepKind.PREEMPTED_OTHER,
                                 f"preempted {name(other.req_id)} ({mode}{figure})", freed,
                                 other_req_id=shown(other.req_id),
                                 worker_id=other.decode_worker_id,
                                 detail={"mode": mode, "triggered_by": first.triggered_by}))

    # 3. This request's own phases in order.
    for p in parts:
        first = p.opened_by
        if p.kind is PhaseKind.PREFILL:
            hit = max((r.kv_reuse_hit for r in p.records), default=0)
            reuse = f", {hit} prompt blocks from prefix cache" if hit else ""
            where = f" on {log.prefill_worker_id}" if log.prefill_worker_id else ""
            steps.append(WhyStep(StepKind.PREFILL, f"prefill {ms(p.duration_s)}{where}{reuse}",
                                 p.duration_s, worker_id=log.prefill_worker_id,
                                 detail={"kv_reuse_hit": hit}))
        elif p.kind is PhaseKind.TRANSFER:
            steps.append(_transfer_step(p, log))
        elif p.kind is PhaseKind.PREEMPTION and first is not None:
            mode = PREEMPT_MODES.get(first.decision, first.decision.value)
            by = f" for {name(first.blocking_req_id)}" if first.blocking_req_id else ""
            after = _resume_words(log, p)
            figure = f", {ms(p.duration_s)}" if p.duration_s >= 0.0005 else ""
            steps.append(WhyStep(StepKind.PREEMPTED,
                                 f"was preempted{by} ({mode}{figure}){after}",
                                 p.duration_s, other_req_id=shown(first.blocking_req_id),
                                 detail={"mode": mode, "triggered_by": first.triggered_by,
                                         "mem_pressure": first.mem_pressure}))
    if not any(p.kind is PhaseKind.TRANSFER for p in parts) and log.transfers:
        for t in log.transfers:
            steps.append(_transfer_words(t))
    decode = [p for p in parts if p.kind is PhaseKind.DECODE]
    if decode and log.num_output_tokens > 1:
        span = sum(p.duration_s for p in decode)
        tpot = span / (log.num_output_tokens - 1)
        steps.append(WhyStep(StepKind.DECODE, f"decoded {log.num_output_tokens} tokens at "
                             f"{ms(tpot)} per token", span, worker_id=log.decode_worker_id,
                             detail={"tpot_s": tpot}))

    # 4. How it ended and whether that was late.
    last = sorted(log.records, key=lambda r: r.time)[-1] if log.records else None
    state = last.to_state if last else RequestState.QUEUED
    if last is not None and state in (RequestState.REJECTED, RequestState.ABORTED):
        steps.append(WhyStep(StepKind.ENDED, f"{state.value} ({last.triggered_by})",
                             detail={"decision": last.decision.value}))
    ttft = _ttft(log)
    end = log.finish_time if log.finish_time is not None else now
    e2e = None if end is None else max(0.0, end - log.arrival_time)
    late, verdict = _verdict(spec.ttft_s, spec.tpot_s, spec.e2e_s, ttft, e2e, log, decode,
                             state.is_finished)
    steps.append(WhyStep(StepKind.VERDICT, verdict, detail={"late": late}))

    head = steps[0].text if steps and steps[0].kind is StepKind.QUEUED else "started at once"
    rest = [s.text for s in steps if s is not steps[0] or s.kind is not StepKind.QUEUED]
    text = f"{_tier_label(log.tier)} request {req_id} {head}: " + "; ".join(rest)
    return WhyReport(req_id=req_id, tier=log.tier, state=state.value, waited_s=waited,
                     ttft_s=ttft, e2e_s=e2e, late=late, steps=tuple(steps), text=text)


def _was_preempted_for(logs: Mapping[str, RequestLog], victim: str, req_id: str) -> bool:
    o = logs.get(victim)
    return o is not None and any(
        r.decision in PREEMPT_MODES and r.blocking_req_id == req_id for r in o.records
    )


def _freeing_time(p: Phase) -> float:
    """How long the victim took to give its memory back: PREEMPTING until PREEMPTED."""
    done = next((r for r in p.records if r.to_state is RequestState.PREEMPTED), None)
    return 0.0 if done is None else max(0.0, done.time - p.start)


def _resume_words(log: RequestLog, p: Phase) -> str:
    after = next((r for r in log.records if r.time >= p.end and r.from_state in
                  (RequestState.PREEMPTED, RequestState.PREEMPTING)), None)
    if after is None:
        return ""
    words = _RESUME_WORDS.get(after.decision)
    if words is None and after.to_state is RequestState.QUEUED:
        words = "re-queued for recompute"
    return f", {words}" if words else ""


def _transfer_words(t: TransferInfo) -> WhyStep:
    words = TOPOLOGY_WORDS.get(t.topology_class, f"transfer ({t.topology_class})")
    return WhyStep(StepKind.TRANSFER,
                   f"{words} ({ms(t.seconds)}, {t.src_worker_id} -> {t.dst_worker_id})",
                   t.seconds, worker_id=t.dst_worker_id,
                   detail={"topology_class": t.topology_class, "num_bytes": t.num_bytes})


def _transfer_step(p: Phase, log: RequestLog) -> WhyStep:
    match = [t for t in log.transfers if p.start - 1e-9 <= t.start_time <= p.end + 1e-9]
    if match:
        t = match[0]
        step = _transfer_words(t)
        # The phase (scheduler clock) is what the request lived through.
        return WhyStep(step.kind, step.text.replace(ms(t.seconds), ms(p.duration_s), 1),
                       p.duration_s, worker_id=step.worker_id,
                       detail={**step.detail, "transfer_seconds": t.seconds})
    return WhyStep(StepKind.TRANSFER, f"transfer {ms(p.duration_s)}", p.duration_s,
                   worker_id=log.decode_worker_id)


_FIRST_TOKEN_STATES = frozenset({RequestState.TRANSFERRING, RequestState.DECODING,
                                 RequestState.FINISHED_STOPPED, RequestState.FINISHED_LENGTH})


def _ttft(log: RequestLog) -> float | None:
    """From ``first_token_time``, else from the end of the first prefill that completed."""
    if log.first_token_time is not None:
        return max(0.0, log.first_token_time - log.arrival_time)
    done = next((r for r in sorted(log.records, key=lambda r: r.time)
                 if r.from_state is RequestState.PREFILLING and r.to_state in _FIRST_TOKEN_STATES),
                None)
    return None if done is None else max(0.0, done.time - log.arrival_time)


def _verdict(ttft_target: float | None, tpot_target: float | None, e2e_target: float | None,
             ttft: float | None, e2e: float | None, log: RequestLog, decode: list[Phase],
             finished: bool) -> tuple[bool | None, str]:
    missed: list[str] = []
    met: list[str] = []
    if ttft_target is not None and ttft is not None:
        (missed if ttft > ttft_target else met).append(
            f"TTFT {ms(ttft)} vs {ms(ttft_target)} target")
    if tpot_target is not None and decode and log.num_output_tokens > 1:
        tpot = sum(p.duration_s for p in decode) / (log.num_output_tokens - 1)
        (missed if tpot > tpot_target else met).append(
            f"TPOT {ms(tpot)} vs {ms(tpot_target)} target")
    if e2e_target is not None and e2e is not None and (finished or e2e > e2e_target):
        (missed if e2e > e2e_target else met).append(
            f"end to end {ms(e2e)} vs {ms(e2e_target)} target")
    if missed:
        return True, "late: " + ", ".join(missed)
    if not finished:
        return None, "not finished" + (": " + ", ".join(met) if met else "")
    return False, "on time: " + ", ".join(met) if met else "on time"

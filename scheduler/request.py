"""The request model and its one state machine (DESIGN §4).

A request is admitted once, placed once, and from then on only its state
changes. Every change goes through :func:`transition`, which refuses moves the
table does not allow and returns a :class:`DecisionRecord` saying why the move
happened. Those records are what metrics, traces and "why was my request
late" answers are made of, so they are kept on the request (``history``).

Life of a request::

    QUEUED ──▶ PREFILLING ──▶ TRANSFERRING ──▶ DECODING ──▶ FINISHED_STOPPED | FINISHED_LENGTH
       ▲            │                               │  ▲
       │            ▼                               ▼  │ resume (swap-in / migrate)
       └──────── PREEMPTED ◀──────────────────── PREEMPTING
    any live state ──▶ ABORTED          QUEUED ──▶ REJECTED (admission)

PREEMPTED goes back to QUEUED when the request will be recomputed, and
straight to DECODING when its blocks come back (swap-in or migration).
PREFILLING may go straight to DECODING when prefill and decode share a worker
(a recompute on the decode worker), and straight to FINISHED when the first
token is also the last.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    PREEMPTING = "preempting"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    ABORTED = "aborted"
    REJECTED = "rejected"

    @property
    def is_finished(self) -> bool:
        """Terminal: the request holds no blocks and will not move again."""
        return self in _TERMINAL

    @property
    def is_running(self) -> bool:
        """Holds KV blocks on some worker and makes progress there."""
        return self in _RUNNING


_TERMINAL = frozenset(
    {
        RequestState.FINISHED_STOPPED,
        RequestState.FINISHED_LENGTH,
        RequestState.ABORTED,
        RequestState.REJECTED,
    }
)
_RUNNING = frozenset(
    {RequestState.PREFILLING, RequestState.TRANSFERRING, RequestState.DECODING}
)

_S = RequestState
ALLOWED_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.QUEUED: frozenset({_S.PREFILLING, _S.REJECTED, _S.ABORTED}),
    _S.PREFILLING: frozenset(
        {
            _S.TRANSFERRING,
            _S.DECODING,
            _S.PREEMPTED,
            _S.FINISHED_STOPPED,
            _S.FINISHED_LENGTH,
            _S.ABORTED,
        }
    ),
    # A failed transfer drops the partial blocks: the request is recomputed.
    _S.TRANSFERRING: frozenset({_S.DECODING, _S.PREEMPTED, _S.ABORTED}),
    _S.DECODING: frozenset(
        {_S.PREEMPTING, _S.FINISHED_STOPPED, _S.FINISHED_LENGTH, _S.ABORTED}
    ),
    # PREEMPTING -> DECODING: the swap-out was cancelled before it started.
    _S.PREEMPTING: frozenset({_S.PREEMPTED, _S.DECODING, _S.ABORTED}),
    _S.PREEMPTED: frozenset({_S.QUEUED, _S.DECODING, _S.ABORTED}),
    _S.FINISHED_STOPPED: frozenset(),
    _S.FINISHED_LENGTH: frozenset(),
    _S.ABORTED: frozenset(),
    _S.REJECTED: frozenset(),
}


class Decision(enum.Enum):
    """What the deciding code chose; the reason a transition happened."""

    ADMIT = "admit"
    REJECT = "reject"
    SCHEDULE_PREFILL = "schedule_prefill"
    START_TRANSFER = "start_transfer"
    START_DECODE = "start_decode"
    FINISH_STOP = "finish_stop"
    FINISH_LENGTH = "finish_length"
    PREEMPT_SWAP = "preempt_swap"
    PREEMPT_RECOMPUTE = "preempt_recompute"
    PREEMPT_MIGRATE = "preempt_migrate"
    PREEMPT_DONE = "preempt_done"
    RESUME_SWAP_IN = "resume_swap_in"
    RESUME_RECOMPUTE = "resume_recompute"
    RESUME_MIGRATE = "resume_migrate"
    TRANSFER_FAILED = "transfer_failed"
    WORKER_FAILED = "worker_failed"
    CLIENT_GONE = "client_gone"
    DEADLINE = "deadline"
    ERROR = "error"


class IllegalTransition(Exception):
    """A move the transition table does not allow: a bug in the caller."""


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One state change of one request and why it happened.

    ``mem_pressure`` is the deciding worker's KV use in [0, 1]; ``slo_slack``
    is seconds left to the request's binding deadline (negative: already late);
    ``kv_reuse_hit`` is the number of prompt blocks served from a prefix cache;
    ``blocking_req_id`` names the request this one waited on or was preempted for.
    """

    req_id: str
    from_state: RequestState
    to_state: RequestState
    decision: Decision
    triggered_by: str
    time: float
    mem_pressure: float = 0.0
    slo_slack: float = 0.0
    kv_reuse_hit: int = 0
    blocking_req_id: str | None = None

    def to_dict(self) -> dict[str, object]:
        """Plain types only, for msgpack and JSON."""
        return {
            "req_id": self.req_id,
            "from": self.from_state.value,
            "to": self.to_state.value,
            "decision": self.decision.value,
            "triggered_by": self.triggered_by,
            "time": self.time,
            "mem_pressure": self.mem_pressure,
            "slo_slack": self.slo_slack,
            "kv_reuse_hit": self.kv_reuse_hit,
            "blocking_req_id": self.blocking_req_id,
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> DecisionRecord:
        return cls(
            req_id=str(d["req_id"]),
            from_state=RequestState(d["from"]),
            to_state=RequestState(d["to"]),
            decision=Decision(d["decision"]),
            triggered_by=str(d["triggered_by"]),
            time=float(d["time"]),  # type: ignore[arg-type]
            mem_pressure=float(d.get("mem_pressure", 0.0)),  # type: ignore[arg-type]
            slo_slack=float(d.get("slo_slack", 0.0)),  # type: ignore[arg-type]
            kv_reuse_hit=int(d.get("kv_reuse_hit", 0)),  # type: ignore[arg-type]
            blocking_req_id=(
                None if d.get("blocking_req_id") is None else str(d["blocking_req_id"])
            ),
        )


@dataclass(slots=True)
class Request:
    """A request as the scheduler sees it: sizes, tier, progress, where it runs.

    Token ids and sampling parameters live with the workers; the kernel only
    needs lengths and the prompt's block hashes (prefix identity).
    """

    req_id: str
    tier: int
    arrival_time: float
    prompt_len: int
    max_new_tokens: int
    # Chained hashes of the prompt's full blocks: equal hashes, equal prefix.
    block_hashes: tuple[int, ...] = ()
    state: RequestState = RequestState.QUEUED
    # Prompt (or prompt + output, after a recompute) tokens whose KV exists.
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    last_preempt_time: float | None = None
    num_preemptions: int = 0
    prefill_worker_id: str | None = None
    decode_worker_id: str | None = None
    history: list[DecisionRecord] = field(default_factory=list)

    @property
    def num_context_tokens(self) -> int:
        """Tokens whose KV the request needs to decode its next token."""
        return self.prompt_len + self.num_output_tokens

    def num_blocks_needed(self, block_size: int, extra_tokens: int = 0) -> int:
        """Blocks to hold the current context plus ``extra_tokens`` more."""
        n = self.num_context_tokens + extra_tokens
        return -(-n // block_size)

    def reached_length(self, max_model_len: int | None = None) -> bool:
        """It ends now with FINISHED_LENGTH: its output reached its budget, or its sequence
        the longest one a worker serves (``max_model_len``, vLLM's meaning; no longer than a
        worker's KV holds, or a request that outgrew it could never be placed again)."""
        return self.num_output_tokens >= self.max_new_tokens or (
            max_model_len is not None and self.num_context_tokens >= max_model_len)


def transition(
    req: Request,
    to: RequestState,
    *,
    decision: Decision,
    triggered_by: str,
    now: float,
    mem_pressure: float = 0.0,
    slo_slack: float = 0.0,
    kv_reuse_hit: int = 0,
    blocking_req_id: str | None = None,
) -> DecisionRecord:
    """Move ``req`` to ``to`` and record why; refuse moves the table forbids.

    Also keeps the timestamps that depend only on the state: ``finish_time``
    on a terminal state, ``last_preempt_time``/``num_preemptions`` on entering
    PREEMPTING or PREEMPTED from a running state.
    """
    frm = req.state
    if to not in ALLOWED_TRANSITIONS[frm]:
        raise IllegalTransition(f"request {req.req_id}: {frm.value} -> {to.value} is not allowed")
    record = DecisionRecord(
        req_id=req.req_id,
        from_state=frm,
        to_state=to,
        decision=decision,
        triggered_by=triggered_by,
        time=now,
        mem_pressure=mem_pressure,
        slo_slack=slo_slack,
        kv_reuse_hit=kv_reuse_hit,
        blocking_req_id=blocking_req_id,
    )
    req.state = to
    if to.is_finished:
        req.finish_time = now
    elif to is RequestState.PREEMPTING or (
        to is RequestState.PREEMPTED and frm is not RequestState.PREEMPTING
    ):
        req.last_preempt_time = now
        req.num_preemptions += 1
    req.history.append(record)
    return record

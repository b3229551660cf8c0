"""Typed messages between the router, the global scheduler and the workers (DESIGN §2, §7).

Every message that crosses a process boundary is one of the frozen dataclasses below,
registered under a short tag. :func:`encode` packs it as msgpack ``[tag, field, ...]``
(nested messages, tuples, enums and plain values only); :func:`decode` rebuilds it and
refuses anything that is not a registered message, so nothing is ever unpickled and a
malformed frame raises :class:`MessageError` instead of running code.

The flows, in the order a request meets them::

    router ──SubmitBatch──▶ scheduler ──SubmitAnswers──▶ router
    scheduler ──Dispatch──▶ decode worker ──DispatchAnswer──▶ scheduler
    decode worker ──StartPrefill──▶ prefill worker          (disaggregated prefill)
    prefill worker ──PrefilledBatch──▶ decode worker          (first tokens of one step)
    decode worker ──TokenBatch──▶ router                      (one message per step)
    workers ──WorkerReport──▶ scheduler                       (events, blocks, step costs)
    router ──FinishBatch──▶ scheduler                         (client-side timings)
    scheduler ──NoticeBatch──▶ router                         (requests ended by the cluster)

and, when the kernel moves a decoding request to another decode worker (migration)::

    decode worker ──MigrateIn──▶ decode worker ──MigrateAnswer──▶ (a ticket; the KV follows
                                                                  over kvtransfer)

and the ones that heal the cluster after a failure::

    worker ──WorkerHello──▶ scheduler ──HelloAnswer──▶ worker  (at setup, and whenever the
                                                               scheduler does not know it)
    router ──Claim──▶ scheduler ──ClaimAnswer──▶ router        (after the scheduler restarted)

This module sits at the bottom floor so every package can share it; it imports only
msgpack, the standard library and ``scheduler.topology`` (plain values).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from scheduler.topology import TopologyClass, classify


class MessageError(ValueError):
    """A frame that is not a well-formed registered message."""


_REGISTRY: dict[str, type] = {}
_TAGS: dict[type, str] = {}
_ENUMS: dict[str, type[enum.Enum]] = {}
_FIELDS: dict[type, tuple[tuple[str, Any], ...]] = {}

T = TypeVar("T")


def message(tag: str):  # noqa: ANN201 - a class decorator
    """Register a frozen dataclass as a wire message under ``tag``."""

    def wrap(cls: type[T]) -> type[T]:
        if tag in _REGISTRY:
            raise TypeError(f"message tag {tag!r} registered twice")
        _REGISTRY[tag] = cls
        _TAGS[cls] = tag
        return cls

    return wrap


def wire_enum(cls: type[enum.Enum]) -> type[enum.Enum]:
    _ENUMS[cls.__name__] = cls
    return cls


def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    got = _FIELDS.get(cls)
    if got is None:
        hints = typing.get_type_hints(cls)
        got = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))
        _FIELDS[cls] = got
    return got


def _to_wire(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    tag = _TAGS.get(type(value))
    if tag is not None:
        return [tag, *(_to_wire(getattr(value, name)) for name, _ in _fields(type(value)))]
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    raise MessageError(f"cannot encode a {type(value).__name__}")


def _from_wire(raw: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        if raw is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _from_wire(raw, inner[0]) if len(inner) == 1 else raw
    if hint is Any:
        return raw
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(raw)
        except ValueError:
            raise MessageError(f"{raw!r} is not a {hint.__name__}") from None
    if isinstance(hint, type) and hint in _TAGS:
        return _build(raw, expect=hint)
    if origin is tuple:
        if not isinstance(raw, (list, tuple)):
            raise MessageError(f"expected a list, got {type(raw).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            if args[0] is int:  # token ids: the hot case, checked in one pass
                if not all(type(v) is int for v in raw):
                    raise MessageError("expected a list of integers")
                return tuple(raw)
            return tuple(_from_wire(v, args[0]) for v in raw)
        if len(args) != len(raw):
            raise MessageError(f"expected {len(args)} items, got {len(raw)}")
        return tuple(_from_wire(v, a) for v, a in zip(raw, args, strict=True))
    if origin is dict:
        if not isinstance(raw, dict):
            raise MessageError(f"expected a map, got {type(raw).__name__}")
        return {_from_wire(k, args[0]): _from_wire(v, args[1]) for k, v in raw.items()}
    if hint is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise MessageError(f"expected a number, got {type(raw).__name__}")
        return float(raw)
    if hint in (int, str, bool, bytes):
        if not isinstance(raw, hint) or (hint is int and isinstance(raw, bool)):
            raise MessageError(f"expected {hint.__name__}, got {type(raw).__name__}")
        return raw
    return raw


def _build(raw: Any, expect: type | None = None) -> Any:
    if not isinstance(raw, (list, tuple)) or not raw or not isinstance(raw[0], str):
        raise MessageError("a message is a list headed by its tag")
    cls = _REGISTRY.get(raw[0])
    if cls is None:
        raise MessageError(f"unknown message tag {raw[0]!r}")
    if expect is not None and cls is not expect:
        raise MessageError(f"expected a {expect.__name__}, got a {cls.__name__}")
    fields = _fields(cls)
    if len(raw) - 1 != len(fields):
        raise MessageError(f"{cls.__name__}: {len(raw) - 1} fields, expected {len(fields)}")
    kwargs = {}
    for (name, hint), value in zip(fields, raw[1:], strict=True):
        try:
            kwargs[name] = _from_wire(value, hint)
        except MessageError as e:
            raise MessageError(f"{cls.__name__}.{name}: {e}") from None
    return cls(**kwargs)


def encode(msg: Any) -> bytes:
    """A registered message as msgpack bytes."""
    if type(msg) not in _TAGS:
        raise MessageError(f"{type(msg).__name__} is not a registered message")
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def decode(data: bytes, expect: type[T] | None = None) -> T:
    """Bytes back into the message; ``expect`` refuses any other kind."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise MessageError(f"not msgpack: {e}") from None
    return _build(raw, expect)  # type: ignore[return-value]


# -- requests ------------------------------------------------------------------------


@message("samp")
@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """How a request samples (engine.sampling.SamplingParams' fields; neutral defaults).
    ``n``: sequences generated from the prompt; ``grammar_kind`` (an
    engine.grammar.GrammarKind value, "" for none) and ``grammar``: structured output."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    grammar_kind: str = ""
    grammar: str = ""

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@message("gen")
@dataclass(frozen=True, slots=True)
class GenerationSpec:
    """One request as the cluster runs it: prompt tokens, sampling, tier, who streams it."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    tier: int
    tenant: str
    arrival_time: float
    # Token ids that end generation besides the model's EOS (stop strings are the router's).
    stop_token_ids: tuple[int, ...] = ()
    # The router replica whose token subscription carries this request's output.
    router_id: str = ""


@message("sub")
@dataclass(frozen=True, slots=True)
class SubmitBatch:
    specs: tuple[GenerationSpec, ...]


@wire_enum
class SubmitOutcome(enum.Enum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"  # admission (overload): 429 with retry-after
    INVALID = "invalid"  # the request can never run (tier, duplicate id): 400
    UNAVAILABLE = "unavailable"  # no live worker: 503


@message("ans")
@dataclass(frozen=True, slots=True)
class SubmitAnswer:
    req_id: str
    outcome: SubmitOutcome
    reason: str = ""
    retry_after_s: float | None = None


@message("anss")
@dataclass(frozen=True, slots=True)
class SubmitAnswers:
    answers: tuple[SubmitAnswer, ...]
    # Per tier: seconds new arrivals of that tier are shed for (router-side), 0 if open.
    shed_s_by_tier: tuple[float, ...] = ()


# -- KV transfer tickets -------------------------------------------------------------
# What a decode worker's KVConsumer hands a producer (kvtransfer) through the control plane:
# where its endpoint is, what its pool holds, and which slots to fill. Built by
# ``KVConsumer.expect``, checked (types, lengths, ranges) by ``KVProducer.begin``.


@message("kvsrv")
@dataclass(frozen=True, slots=True)
class KVServer:
    """An endpoint's rendezvous server: a TCP store (gloo, NCCL), or for the in-process mock
    backend its hub's name and the server's number on it."""

    host: str
    port: int


@message("kvloc")
@dataclass(frozen=True, slots=True)
class KVLocation:
    """Where a worker's KV pool lives. ``host`` is the address peers reach its endpoint at;
    ``nvlink_domain`` None: none known (never the same domain as another)."""

    node_id: str
    device: str = "cpu"  # "cpu", "cuda:0", ...
    nvlink_domain: str | None = None
    host: str = "127.0.0.1"

    def topology_to(self, other: KVLocation) -> TopologyClass:
        """How far a block travels from here to ``other``: the scheduler's one rule."""
        return classify(self.node_id, self.device, self.nvlink_domain,
                        other.node_id, other.device, other.nvlink_domain)


@message("kvpool")
@dataclass(frozen=True, slots=True)
class KVPoolShape:
    """A KV pool's block geometry and dtype (kvtransfer.layout.KVLayout without the device):
    two pools can exchange blocks when theirs are equal."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # kvtransfer.layout.WIRE_DTYPES


@message("kvend")
@dataclass(frozen=True, slots=True)
class KVEndpoint:
    """A KVConsumer or KVProducer as its peers reach it."""

    endpoint_id: str
    backend: str  # kvtransfer Backend.name: "dist" | "mock"; both ends must use the same
    server: KVServer
    location: KVLocation
    layout: KVPoolShape


@message("kvtkt")
@dataclass(frozen=True, slots=True)
class KVTicket:
    """A consumer's reservation for one request's KV: the slots in prompt order, the
    positions already there (prefix hits, never sent), the channel tag and segment size of
    the transfer, and the consumer's endpoint with the secret a producer proves it holds
    when it opens a pair (kvtransfer.auth)."""

    req_id: str
    block_ids: tuple[int, ...]
    present: tuple[int, ...]
    tag: int
    segment_blocks: int
    consumer: KVEndpoint
    secret: str


# -- placement -----------------------------------------------------------------------


@message("disp")
@dataclass(frozen=True, slots=True)
class Dispatch:
    """Scheduler -> decode worker: reserve the request's blocks and get it prefilled,
    on ``prefill_worker_id`` (KV streamed here) or, when None, on this worker itself."""

    spec: GenerationSpec
    prefill_worker_id: str | None
    num_blocks: int
    # Prompt plus tokens already streamed to the client (a recompute after a failure).
    num_output_tokens: int = 0
    first_token_time: float | None = None
    # The prompt's chained full-block hashes, computed once where it arrived (the global
    # scheduler) and carried to the workers that order and protect prefixes by them.
    block_hashes: tuple[int, ...] = ()


@message("dans")
@dataclass(frozen=True, slots=True)
class DispatchAnswer:
    req_id: str
    ok: bool
    num_free_blocks: int
    num_cached_blocks: int = 0
    reason: str = ""
    # The request can never run (a bad prompt): end it with ``reason``, do not requeue.
    fatal: bool = False


@message("start")
@dataclass(frozen=True, slots=True)
class StartPrefill:
    """Decode worker -> prefill worker: prefill ``spec`` into the slots ``ticket`` names."""

    spec: GenerationSpec
    decode_worker_id: str
    ticket: KVTicket
    block_hashes: tuple[int, ...] = ()  # the Dispatch's: the prompt is hashed once


@message("pre1")
@dataclass(frozen=True, slots=True)
class Prefilled:
    req_id: str
    first_token: int
    finish: str | None = None  # the first token is also the last ("stop" | "length")
    time: float = 0.0
    # The prefill failed on this request alone (``step_failed: ...``): no token, no KV
    # will come; the decode worker ends it with this error (its router is told).
    error: str | None = None
    # The first token of every sequence as its router will get it (seq, logprobs, the
    # prompt's logprobs and cached tokens on sequence 0; no finish: the decode worker's
    # engine decides that); empty for a plain request (``first_token`` says it all).
    deltas: tuple[TokenDelta, ...] = ()


@message("pres")
@dataclass(frozen=True, slots=True)
class PrefilledBatch:
    """Prefill worker -> one decode worker: the first tokens one step produced."""

    items: tuple[Prefilled, ...]


@wire_enum
class PreemptMode(enum.Enum):
    """How a decode gives its blocks up: its KV to host memory, dropped to be prefilled
    again, or moved to another decode worker (``scheduler.preemption`` decides which)."""

    SWAP = "swap"
    RECOMPUTE = "recompute"
    MIGRATE = "migrate"


@message("pord")
@dataclass(frozen=True, slots=True)
class PreemptCall:
    """The global scheduler's order to a decode worker: give ``req_id``'s blocks up by
    ``mode`` for ``for_req_id`` (a migration: to ``target_worker_id``)."""

    req_id: str
    mode: PreemptMode
    for_req_id: str | None = None
    target_worker_id: str | None = None


@message("migr")
@dataclass(frozen=True, slots=True)
class MigrateIn:
    """Source decode worker -> target decode worker: take ``spec`` over mid-decode. Its KV
    (the first ``num_computed`` tokens of prompt + ``output_token_ids``) arrives over
    kvtransfer into the blocks the answer's ticket names; the output so far is already
    streamed, the target streams on from it."""

    spec: GenerationSpec
    output_token_ids: tuple[int, ...]
    num_computed: int
    from_worker_id: str
    first_token_time: float | None = None


@message("mans")
@dataclass(frozen=True, slots=True)
class MigrateAnswer:
    """The target's answer: a ticket for the KV (blocks reserved), or why not."""

    req_id: str
    ticket: KVTicket | None = None
    reason: str = ""
    num_cached_blocks: int = 0  # leading blocks the target had cached: not sent


# -- tokens --------------------------------------------------------------------------


@message("tok")
@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New output tokens of one request; ``finish`` on its last delta, ``error`` when the
    cluster gave up on it (the router retries or reports)."""

    req_id: str
    token_ids: tuple[int, ...]
    finish: str | None = None
    error: str | None = None
    seq: int = 0  # which of the request's n sequences
    # One per token of ``token_ids`` when the request asked for logprobs.
    logprobs: tuple[TokenLogprobs, ...] = ()
    # Sequence 0's first delta: the prompt's logprobs (when asked) and how many prompt
    # tokens the prefix cache gave (usage.prompt_tokens_details.cached_tokens).
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    num_cached_tokens: int = 0
    # Where ``token_ids[0]`` sits in the request's output. Set by a decode worker that took
    # the request over by migration (its first delta repeats every token so far, from 0):
    # the router keeps what it has not seen, whichever worker's stream arrives first.
    # None: right after the previous delta of the same worker.
    start: int | None = None


@message("lp")
@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A token's log-probability, its rank (1 = most likely) and the top tokens' ones."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@message("toks")
@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Decode worker -> one router replica: every token of one step for that router."""

    worker_id: str
    deltas: tuple[TokenDelta, ...]


@message("fin")
@dataclass(frozen=True, slots=True)
class FinishTiming:
    """The router's view of an ended request (times are ``time.time()`` seconds)."""

    req_id: str
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    num_output_tokens: int
    outcome: str  # "stop" | "length" | "client_gone" | an error kind


@message("fins")
@dataclass(frozen=True, slots=True)
class FinishBatch:
    items: tuple[FinishTiming, ...]


# Errors after which a router retries the request on the live workers, as a recompute from
# the tokens it has already streamed (the work was lost, not refused). "scheduler_restarted":
# the global scheduler came back without the request (it was queued there, or no worker
# still held it).
RETRYABLE_ERRORS = frozenset({"worker_failed", "transfer_failed", "scheduler_restarted"})


@message("note")
@dataclass(frozen=True, slots=True)
class Notice:
    """Scheduler -> router: the cluster ended ``req_id`` with ``error`` (router retries it
    from the tokens it has, or reports it)."""

    req_id: str
    error: str
    retryable: bool = True


@message("notes")
@dataclass(frozen=True, slots=True)
class NoticeBatch:
    notices: tuple[Notice, ...]
    shed_s_by_tier: tuple[float, ...] = ()


# -- worker reports ------------------------------------------------------------------


@wire_enum
class WorkerEvent(enum.Enum):
    PREFILL_DONE = "prefill_done"  # first token sampled, KV on its way: -> TRANSFERRING
    DECODE_START = "decode_start"  # decode worker added the prefilled request: -> DECODING
    FINISHED_STOP = "finished_stop"
    FINISHED_LENGTH = "finished_length"
    PREEMPTED_SWAP = "preempted_swap"
    PREEMPTED_RECOMPUTE = "preempted_recompute"
    RESUMED_SWAP = "resumed_swap"
    RESUMED_RECOMPUTE = "resumed_recompute"
    # Migration (the source reports the first once its blocks are free, the target the
    # second once the request decodes there; either may arrive first).
    PREEMPTED_MIGRATE = "preempted_migrate"
    RESUMED_MIGRATE = "resumed_migrate"
    ABORTED = "aborted"
    TRANSFER_FAILED = "transfer_failed"


@message("ev")
@dataclass(frozen=True, slots=True)
class ReqEvent:
    req_id: str
    event: WorkerEvent
    time: float
    for_req_id: str | None = None  # preemptions: the request it made room for
    reason: str = ""
    # PREEMPTED_MIGRATE: the decode worker that took the request over (its owner now).
    peer_worker_id: str = ""
    # PREFILL_DONE from a prefill worker: when the request reached the worker and when the
    # step that ran its first chunk began (0.0: not known). With the dispatch and ``time``
    # they split a time to first token into its hops (``tierserve:ttft_part_seconds``).
    received: float = 0.0
    started: float = 0.0


@message("blk")
@dataclass(frozen=True, slots=True)
class BlockEvent:
    stored: bool  # True: the blocks were cached; False: evicted
    block_hashes: tuple[int, ...]
    parent_hash: int | None = None


@message("xfer")
@dataclass(frozen=True, slots=True)
class TransferStat:
    req_id: str
    num_bytes: int
    duration_s: float
    end_time: float
    topology: TopologyClass


@message("run")
@dataclass(frozen=True, slots=True)
class RunningReq:
    """A request that holds KV on the reporting worker."""

    req_id: str
    num_blocks: int
    num_output_tokens: int
    num_prefill_left: int = 0  # prompt tokens still to compute here
    # Of its blocks, those another request on the worker holds too (a shared prompt
    # prefix): its preemption does not free them.
    num_shared_blocks: int = 0


@wire_enum
class LinkKind(enum.Enum):
    """What a measured KV move crossed."""

    MOVE = "move"  # to or from another worker (kvtransfer); its class from the two workers
    SWAP_OUT = "swap_out"  # device pool -> host swap space
    SWAP_IN = "swap_in"  # host swap space -> device pool


@message("lsmp")
@dataclass(frozen=True, slots=True)
class LinkSample:
    """One KV move a worker timed: what the kernel's link model learns from. Only moves
    whose blocks were all ready at the start count (a migration, a swap), not a prefill's
    streamed transfer, whose time is the prefill's."""

    kind: LinkKind
    num_bytes: int
    seconds: float
    peer_worker_id: str = ""  # MOVE: the other worker


@message("rst")
@dataclass(frozen=True, slots=True)
class RestoreStat:
    """A preempted request decodes again: how long bringing its KV back took here (swap:
    the copy in; recompute: from its first recompute chunk to its next token; migrate:
    from the reservation here to the request decoding here)."""

    req_id: str
    mode: PreemptMode
    seconds: float
    from_worker_id: str = ""  # migrate: the source
    # recompute: context tokens the prefix cache still held (not computed again).
    num_cached_tokens: int = 0


@message("kvm")
@dataclass(frozen=True, slots=True)
class KVMemoryReport:
    num_swap_blocks: int | None  # the host swap space's budget, in blocks (None: unbounded)
    num_swap_used: int
    num_swap_peak: int  # most blocks in the swap space at once since the worker started
    # Cumulative prompt blocks looked up in this worker's prefix cache, and hits.
    num_prefix_query_blocks: int = 0
    num_prefix_hit_blocks: int = 0
    link_samples: tuple[LinkSample, ...] = ()
    restores: tuple[RestoreStat, ...] = ()


@message("rep")
@dataclass(frozen=True, slots=True)
class WorkerReport:
    worker_id: str
    num_free_blocks: int
    num_total_blocks: int
    events: tuple[ReqEvent, ...] = ()
    block_events: tuple[BlockEvent, ...] = ()
    transfers: tuple[TransferStat, ...] = ()
    running: tuple[RunningReq, ...] = ()
    # The worker's fitted step cost model (scheduler.step_costs.StepCosts.to_tuple()).
    step_costs: tuple[float, ...] = ()
    num_steps: int = 0
    # ``running`` lists every request the worker holds (the scheduler forgets the ones it
    # leaves out); False: only those whose figures changed since the last report (the
    # others, and the requests events ended, stand as they were).
    is_complete: bool = True
    # The worker has requests its steps must advance (the scheduler's stall watch: busy
    # and ``num_steps`` not moving for a bound means hung).
    is_busy: bool = False
    # Which start of the worker's process sent it (WorkerHello.incarnation; "": unknown).
    incarnation: str = ""
    # Swap space, prefix cache and measured KV moves (decode and prefill workers).
    memory: KVMemoryReport | None = None
    # Seconds this process has spent running steps (a counter: its rate over a window is
    # how busy the worker was, what the SLO planner sizes the pools by).
    step_seconds: float = 0.0
    # False: a part the steps do not exercise is down for good (a decode worker's KV accept
    # thread kept failing: no new pair can open), so the scheduler's watch replaces it.
    is_healthy: bool = True


# -- healing ------------------------------------------------------------------------


@wire_enum
class HeldStage(enum.Enum):
    RECEIVING = "receiving"  # blocks reserved, KV arriving from ``prefill_worker_id``
    PREFILLING = "prefilling"  # prefilled on the worker itself (local prefill, recompute)
    DECODING = "decoding"
    SWAPPED = "swapped"  # preempted to host memory


@message("held")
@dataclass(frozen=True, slots=True)
class HeldRequest:
    """A request a decode worker holds, as it registers: a restarted scheduler adopts it."""

    spec: GenerationSpec
    stage: HeldStage
    num_blocks: int
    num_output_tokens: int
    prefill_worker_id: str | None = None
    first_token_time: float | None = None
    num_prefill_left: int = 0


@message("wset")
@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """Where a worker runs and what its engine holds, as it set up (``cluster.worker_actors``).
    The scheduler builds the worker's ``WorkerInfo`` from it; the driver reads the same as a
    document (``cluster.messages.setup_document``)."""

    node: str
    device: str  # "cpu", "cuda:0", ...
    nvlink_domain: str
    num_total_blocks: int
    num_free_blocks: int
    bytes_per_block: int
    max_model_len: int
    ray_node_id: str = ""
    pid: int = 0


@message("hello")
@dataclass(frozen=True, slots=True)
class WorkerHello:
    """Worker -> scheduler once it has set up, and again whenever the scheduler answers a
    report with "unknown" (it restarted): who it is, where it runs and what its engine holds
    (``info``) and which requests it holds. ``incarnation`` is new with every start of the
    worker's process, so a restart is never mistaken for the old one."""

    worker_id: str
    role: str
    incarnation: str
    info: WorkerSetup
    held: tuple[HeldRequest, ...] = ()


@message("hans")
@dataclass(frozen=True, slots=True)
class HelloAnswer:
    """The held requests the worker must drop: the cluster already ended them."""

    drop_req_ids: tuple[str, ...] = ()


@message("claim")
@dataclass(frozen=True, slots=True)
class Claim:
    """Router -> scheduler when its notice stream opens again: the attempts it still
    waits on. Adopted requests of that router it does not name are ended."""

    router_id: str
    req_ids: tuple[str, ...] = ()


@message("cans")
@dataclass(frozen=True, slots=True)
class ClaimAnswer:
    """The claimed attempts the scheduler does not know (ended by the router, retried)."""

    unknown_req_ids: tuple[str, ...] = ()


@message("abrt")
@dataclass(frozen=True, slots=True)
class AbortBatch:
    req_ids: tuple[str, ...] = field(default_factory=tuple)

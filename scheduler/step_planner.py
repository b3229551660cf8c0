"""One worker's next engine step: which prefill chunks and which decodes run in it.

The global scheduler (:mod:`scheduler.cluster_scheduler`) decides where a request runs;
this module decides, step by step, what a worker's engine runs, so nothing orders
requests first come first served between the policy and the engine (DESIGN §2). Real
workers and the simulator's workers both hold a :class:`WorkerScheduler` and execute the
:class:`StepPlan` it returns.

Life of a request on one worker's scheduler (STYLE.md item 7):

1. ``add_prefill``: a request whose prompt (or prompt + output, on recompute) is computed
   here joins the worker's wait queue, ordered by the policy (``policy.make_queue()``).
2. ``plan``: the policy composes the step (``policy.compose_step``): the decode batch, the
   prefill chunks in policy order within the step's token and time budget, victims when
   decode growth finds no block, swapped requests that can come back. A worker built with
   ``num_decode_steps`` n > 1 runs n decode iterations per planned step (multi-step
   decoding, as vLLM's ``--num-scheduler-steps``): each decode grows by up to n tokens, and
   the blocks for all of them are found before the step.
3. ``commit``: after the engine ran the plan, chunks advance; a finished prefill leaves
   (a prefill-only worker) or starts decoding here (its first token is out); the measured
   step time trains the worker's :class:`~scheduler.step_costs.StepCosts`.
4. ``add_decode`` (a prefilled request joins after its transfer), ``swap_out`` /
   ``swap_in``, ``remove`` (finished, aborted, preempted by recompute).

The composition rules themselves are the policy's (``compose_budget_step`` for the vLLM
v1 style budget, ``compose_slo_step`` for tierserve's) and live here as functions. Given an
``on_pick`` callback, the planner reports each selection it made (which prefills got a
chunk, which decodes ran, which growers got a block, which swapped requests came back) as
a :class:`~scheduler.queues.Pick`, with the candidates it passed over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.preemption import PreemptionPlan, PreemptMode, Victim, VictimView
from scheduler.queues import OnPick, Pick, PickSite, Verdict, WaitQueue, recording, unconsidered
from scheduler.request import Request, RequestState
from scheduler.step_costs import StepCosts, StepShape
from scheduler.topology import WorkerInfo


class SchedulingPolicy(Protocol):
    """What a step reads of a policy (``scheduler.policy.SchedulingPolicy`` fits)."""

    def order(self, reqs: Sequence[Request], now: float) -> list[Request]: ...

    def make_queue(self) -> WaitQueue: ...

    def on_kv_pressure(self, need_blocks: int, candidates: Sequence[VictimView], now: float,
                       requester_tier: int) -> PreemptionPlan: ...

    def compose_step(self, view: StepView) -> StepPlan: ...

# Blocks a preemption freed for an arrival stay out of this worker's own plans (no swap-in,
# no local admission takes them) until that arrival is dispatched here, or this long.
HOLD_S = 2.0
# A step that has prefills waiting gives the most urgent one at least this many tokens,
# even when the decodes alone fill the time budget: TTFT always progresses.
MIN_CHUNK_TOKENS = 32


@dataclass(slots=True)
class LocalRequest:
    """A request on one worker, as the step planner sees it."""

    req: Request
    # Tokens whose KV must exist here when the prefill (or recompute) ends.
    num_target: int = 0
    # Tokens whose KV exists here (the context a decode attends to).
    num_computed: int = 0
    num_blocks: int = 0
    is_swapped: bool = False

    @property
    def req_id(self) -> str:
        return self.req.req_id

    @property
    def num_prefill_left(self) -> int:
        """Tokens still to compute here before the next token is sampled (0: decoding)."""
        return max(self.num_target - self.num_computed, 0)

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the engine runs next; every field says why it is there.

    ``decodes``: running requests that produce one token each. ``chunks``: (request,
    tokens) prefill chunks, most urgent first. ``preempt``: victims evicted before the step
    so that the decodes that need a new block get one (KV pressure). ``swap_in``: swapped
    requests whose blocks come back before the step. ``predicted_s``: the step's time by
    the worker's fitted cost model."""

    decodes: tuple[str, ...] = ()
    chunks: tuple[tuple[str, int], ...] = ()
    preempt: tuple[Victim, ...] = ()
    swap_in: tuple[str, ...] = ()
    predicted_s: float = 0.0

    @property
    def is_empty(self) -> bool:
        return not (self.decodes or self.chunks or self.preempt or self.swap_in)


@dataclass(slots=True)
class StepView:
    """What a policy composes a step from (read-only by contract)."""

    now: float
    worker: WorkerInfo
    decoding: list[LocalRequest]  # running decodes, in the order they joined
    queue: WaitQueue  # prefill candidates (started or not), in policy order
    local: dict[str, LocalRequest]
    swapped: list[LocalRequest]
    num_free_blocks: int
    block_size: int
    costs: StepCosts
    max_num_seqs: int
    max_num_batched_tokens: int
    chunk_tokens: int
    taken: list[str] = field(default_factory=list)  # prefills offered and taken
    # Decode iterations the step runs (each decode grows by up to this many tokens).
    num_decode_steps: int = 1
    # A request is not preempted twice within this window (the tiers' anti-thrash).
    anti_thrash_s: float = 1.0
    # Selections made, when the caller asked for them (None: not recorded).
    picks: list[Pick] | None = None
    # Free blocks of the worker's host swap space (None: unbounded): a KV-pressure victim
    # is swapped only while it fits.
    num_free_swap_blocks: int | None = None

    def record(self, site: PickSite, offers: list[tuple[Request, Verdict]],
               rest: Sequence[Request] = ()) -> None:
        if self.picks is not None:
            self.picks.append(Pick(site, self.worker.worker_id, self.now, tuple(offers),
                                   tuple(rest)))


def decode_tokens(lr: LocalRequest, num_steps: int) -> int:
    """Tokens a decode produces in a step of ``num_steps`` iterations (fewer at its end)."""
    return max(1, min(num_steps, lr.req.max_new_tokens - lr.req.num_output_tokens))


def _growth(decodes: Sequence[LocalRequest], bs: int, num_steps: int) -> dict[str, int]:
    """Decodes whose next tokens start new blocks, and how many blocks each needs."""
    out: dict[str, int] = {}
    if num_steps == 1:  # one token each (the common case, kept cheap: it runs every step)
        for d in decodes:
            need = (d.num_computed + bs) // bs - d.num_blocks
            if need > 0:
                out[d.req.req_id] = need
        return out
    for d in decodes:
        need = -(-(d.num_computed + decode_tokens(d, num_steps)) // bs) - d.num_blocks
        if need > 0:
            out[d.req_id] = need
    return out


def _pressure(view: StepView, decodes: list[LocalRequest], policy: SchedulingPolicy
              ) -> tuple[list[LocalRequest], list[Victim], int]:
    """Decodes that can run, victims the policy evicts for them, blocks left after."""
    growth = _growth(decodes, view.block_size, view.num_decode_steps)
    free = view.num_free_blocks
    victims: list[Victim] = []
    if sum(growth.values()) > free:
        cands = [VictimView(d.req, view.worker, d.num_blocks,
                            swap_room=view.num_free_swap_blocks) for d in decodes]
        top = min(d.req.tier for d in decodes if d.req_id in growth)
        plan = policy.on_kv_pressure(sum(growth.values()) - free, cands, view.now, top)
        victims = list(plan.victims)
        gone = {v.req_id for v in victims}
        freed = sum(v.num_blocks for v in victims)
        decodes = [d for d in decodes if d.req_id not in gone]
        growth = {rid: n for rid, n in growth.items() if rid not in gone}
        free += freed
    if sum(growth.values()) > free:
        # No victim allowed: growers get their blocks in policy order until one does not
        # fit; it and the less urgent ones sit this step out.
        order = policy.order([d.req for d in decodes if d.req_id in growth], view.now)
        stalled: set[str] = set()
        offers = []
        for r in order:
            n = growth[r.req_id]
            if stalled or n > free:
                stalled.add(r.req_id)
                offers.append((r, Verdict.SKIP))
            else:
                free -= n
                offers.append((r, Verdict.TAKE))
        view.record(PickSite.GROW, offers)
        window = view.anti_thrash_s
        outside = [r for r in order if r.last_preempt_time is None
                   or view.now - r.last_preempt_time >= window]
        if decodes and outside and all(d.req_id in stalled for d in decodes):
            # Every decode needs a block and none may be evicted by the policy: nothing
            # would ever run again here. Recompute the last in policy order outside its
            # anti-thrash window (vLLM evicts its lowest-priority running request); the
            # others then grow in its blocks. Inside every window: wait for one to pass.
            last = outside[-1]
            lr = view.local[last.req_id]
            victims.append(Victim(last.req_id, PreemptMode.RECOMPUTE, lr.num_blocks, 0.0))
            free += lr.num_blocks
            decodes = [d for d in decodes if d.req_id != last.req_id]
            fits: set[str] = set()
            for r in order:  # most urgent first, each takes the blocks it needs
                n = growth[r.req_id]
                if r.req_id != last.req_id and n <= free:
                    free -= n
                    fits.add(r.req_id)
                elif r.req_id != last.req_id:
                    break
            decodes = [d for d in decodes if d.req_id in fits or d.req_id not in growth]
        else:
            decodes = [d for d in decodes if d.req_id not in stalled]
    else:
        free -= sum(growth.values())
    return decodes, victims, free


def _swap_ins(view: StepView, free: int, policy: SchedulingPolicy, room: int,
              num_running: int) -> tuple[list[str], int]:
    """Swapped requests back in, in policy order, each only while the blocks left after
    it still give every running decode (``num_running`` of them, and those swapped in)
    its next block: one that came back into exactly its own blocks would be the next
    step's KV-pressure victim (or force one), swap after swap."""
    out: list[str] = []
    if not view.swapped or room <= 0:
        return out, free
    order = policy.order([s.req for s in view.swapped], view.now)
    offers = []
    for r in order:
        lr = view.local[r.req_id]
        if len(out) >= room:
            offers.append((r, Verdict.STOP))
            break
        if lr.num_blocks + num_running + len(out) + 1 > free:
            offers.append((r, Verdict.SKIP))
            break
        out.append(r.req_id)
        offers.append((r, Verdict.TAKE))
        free -= lr.num_blocks
    view.record(PickSite.SWAP_IN, offers, order[len(offers):])
    return out, free


def _take_chunks(view: StepView, token_budget: int, seconds: float | None, base: StepShape,
                 free_blocks: int, room: int, first_min: int, *,
                 uncapped: Callable[[Request], float | None] | None = None,
                 chunk_cap: int | None = None) -> list[tuple[str, int]]:
    """Prefill chunks in queue (policy) order within the budgets. ``uncapped(req)``: a
    looser time budget for that request's chunk (None: only the token budget), for the
    most urgent tier, whose prompt need not wait behind its own chunking. ``chunk_cap``:
    most tokens one request gets in the step (default the worker's chunk)."""
    chunks: list[tuple[str, int]] = []
    left = [token_budget, free_blocks, room]
    shape = [base]
    costs = view.costs
    bs = view.block_size
    cap = view.chunk_tokens if chunk_cap is None else chunk_cap

    def accept(req: Request) -> Verdict:
        if left[0] <= 0:
            return Verdict.STOP
        lr = view.local[req.req_id]
        need = 0
        if lr.num_blocks == 0:  # not started: all of its blocks at once (the engine's rule)
            need = lr.blocks_for(lr.num_computed + lr.num_prefill_left + 1, bs)
            if need > left[1] or left[2] <= 0:
                return Verdict.SKIP
        limit_s = seconds
        take = min(lr.num_prefill_left, left[0], cap)
        if uncapped is not None and req.tier == 0 and not chunks:
            limit_s = uncapped(req)
            take = min(lr.num_prefill_left, left[0])
        if limit_s is not None:
            fit = costs.tokens_within(limit_s, lr.num_computed, base=shape[0])
            if fit < take:
                if chunks or fit >= MIN_CHUNK_TOKENS:
                    take = min(take, fit)
                else:
                    take = min(take, max(fit, first_min))
            if take <= 0:
                return Verdict.STOP
        left[0] -= take
        left[1] -= need
        if need:
            left[2] -= 1
        sh = shape[0]
        shape[0] = StepShape(sh.prefill_tokens + take,
                             sh.prefill_attention + take * (lr.num_computed + take / 2),
                             sh.num_decodes, sh.decode_context)
        chunks.append((req.req_id, take))
        view.taken.append(req.req_id)
        return Verdict.TAKE

    if view.picks is None:
        view.queue.take(view.now, accept)
    else:
        candidates = view.queue.requests()
        offers: list[tuple[Request, Verdict]] = []
        view.queue.take(view.now, recording(accept, offers))
        if candidates:
            view.record(PickSite.PREFILL, offers, unconsidered(candidates, offers))
    return chunks


def _shape(decodes: Sequence[LocalRequest]) -> StepShape:
    return StepShape(num_decodes=len(decodes),
                     decode_context=sum(d.num_computed + 1 for d in decodes))


def _predicted_s(view: StepView, first: StepShape, decodes: Sequence[LocalRequest]) -> float:
    """The step's time: the first iteration (chunks and decodes), then the further decode
    iterations of a multi-step plan."""
    t = view.costs.step_s(first)
    if view.num_decode_steps > 1 and decodes:
        t += (view.num_decode_steps - 1) * view.costs.step_s(_shape(decodes))
    return t


def compose_budget_step(view: StepView, policy: SchedulingPolicy,
                        token_budget: int | None = None, chunk_cap: int | None = None
                        ) -> StepPlan:
    """vLLM v1's step: every running decode, then prefill chunks in queue order within
    ``token_budget`` (``max_num_batched_tokens``; default the worker's), each at most
    ``chunk_cap`` tokens (``long_prefill_token_threshold``; default the worker's chunk).
    Started prefills come first: the peers' queues key on it, as vLLM schedules its
    running requests before its waiting ones."""
    budget = token_budget or view.max_num_batched_tokens
    decodes, victims, free = _pressure(view, list(view.decoding), policy)
    if decodes:
        view.record(PickSite.DECODE, [(d.req, Verdict.TAKE) for d in decodes[: view.max_num_seqs]],
                    [d.req for d in decodes[view.max_num_seqs:]])
    decodes = decodes[: view.max_num_seqs]
    budget -= len(decodes)
    room = view.max_num_seqs - len(decodes)
    swap, free = _swap_ins(view, free, policy, room, len(decodes))
    room -= len(swap)
    chunks = _take_chunks(view, budget, None, _shape(decodes), free, room, budget,
                          chunk_cap=chunk_cap)
    plan_shape = _shape(decodes)
    for rid, n in chunks:
        c = view.local[rid].num_computed
        plan_shape = StepShape(plan_shape.prefill_tokens + n,
                               plan_shape.prefill_attention + n * (c + n / 2),
                               plan_shape.num_decodes, plan_shape.decode_context)
    return StepPlan(tuple(d.req_id for d in decodes), tuple(chunks), tuple(victims),
                    tuple(swap), _predicted_s(view, plan_shape, decodes) if chunks or decodes
                    else 0.0)


def compose_slo_step(view: StepView, policy: SchedulingPolicy, *, step_cap_s: float,
                     tpot_by_tier: Sequence[float | None],
                     tpot_margin: float = 0.8, uncapped_tier: int | None = None) -> StepPlan:
    """tierserve's step, sized by the tiers' targets from the measured step costs.

    Decodes: in policy order, the batch grows while the predicted step stays within
    ``tpot_margin`` x the tightest TPOT target among the decodes in it (a decode whose
    tier has no TPOT target only joins while that still holds). Prefill: chunks in policy
    order within the time left to the tightest target and at most ``step_cap_s`` (so an
    urgent arrival waits at most one short step), the most urgent always getting at least
    ``MIN_CHUNK_TOKENS``. A request of ``uncapped_tier`` that leads the step is not cut by
    the cap, only by the pace its step's decodes can absorb (TPOT is a mean: a decode
    ahead of its pace takes a longer step in its stride): splitting the most urgent
    prompt into short steps would only add their fixed costs to its own first token.
    """
    decodes, victims, free = _pressure(view, list(view.decoding), policy)
    costs = view.costs
    limit = view.max_num_seqs
    if len(decodes) >= limit and view.queue:
        # Every sequence slot is a decode's: an unstarted prefill of a more urgent tier than
        # the least urgent decode takes one slot from it for this step (that decode sits
        # the step out), or it would wait for a lower tier's decode to finish.
        worst = max(d.req.tier for d in decodes)
        if any(r.tier < worst and view.local[r.req_id].num_blocks == 0
               for r in view.queue.requests()):
            limit -= 1
    if len(decodes) > limit:
        # More decodes than slots: the most urgent tiers run, not the oldest (within a tier
        # in join order; a stable sort on the tier alone keeps this step cheap).
        decodes.sort(key=lambda d: d.req.tier)
    batch = decodes[:limit]
    tight: float | None = None
    ctx = 0
    now = view.now
    # One pass: the attended context, the tightest TPOT target, and the pace: the time
    # left before the furthest-behind decode with a target falls behind its mean TPOT.
    pace: float | None = None
    for d in batch:
        ctx += d.num_computed + 1
        r = d.req
        t = tpot_by_tier[r.tier]
        if t is not None:
            if tight is None or t < tight:
                tight = t
            ft = r.first_token_time
            if ft is not None:
                n = r.num_output_tokens
                left = ft + t * (n if n > 1 else 1) - now
                if pace is None or left < pace:
                    pace = left
    all_shape = StepShape(num_decodes=len(batch), decode_context=ctx)
    if tight is not None and costs.step_s(all_shape) > tpot_margin * tight:
        # Too many for the tightest target: most urgent first, each joins while the
        # step still fits the tightest target among those in it.
        order = {r.req_id: i for i, r in enumerate(policy.order([d.req for d in decodes],
                                                                view.now))}
        decodes.sort(key=lambda d: order[d.req_id])
        batch, tight = [], None
        n = ctx = 0
        offers: list[tuple[Request, Verdict]] = []
        for d in decodes:
            if len(batch) >= limit:
                offers.append((d.req, Verdict.STOP))
                break
            t = tpot_by_tier[d.req.tier]
            cand = tight if t is None else (t if tight is None else min(tight, t))
            step = costs.step_s(StepShape(num_decodes=n + 1,
                                          decode_context=ctx + d.num_computed + 1))
            if cand is not None and batch and step > tpot_margin * cand:
                offers.append((d.req, Verdict.SKIP))
                continue  # it waits a step; the tighter tiers keep their pace
            batch.append(d)
            offers.append((d.req, Verdict.TAKE))
            tight = cand
            n += 1
            ctx += d.num_computed + 1
        all_shape = StepShape(num_decodes=n, decode_context=ctx)
        view.record(PickSite.DECODE, offers, [d.req for d in decodes[len(offers):]])
        pace = _pace(batch, tpot_by_tier, view.now)
    elif decodes and view.picks is not None:
        # All of them run in the same step; recorded in policy order (what the tier-order
        # check reads: none was passed over for another).
        ranked = policy.order([d.req for d in batch], view.now)
        view.record(PickSite.DECODE, [(r, Verdict.TAKE) for r in ranked],
                    [d.req for d in decodes[limit:]])
    base = all_shape
    seconds = step_cap_s
    if tight is not None:
        seconds = min(seconds, tpot_margin * tight)
    room = view.max_num_seqs - len(batch)
    swap, free = _swap_ins(view, free, policy, room, len(decodes))
    room -= len(swap)
    budget = view.max_num_batched_tokens - len(batch)
    tpot_bound = None
    if tight is not None:
        # TPOT is a request's mean pace: a decode that ran ahead of its pace can absorb a
        # longer step. The leading most-urgent chunk may take what every decode in the
        # step can absorb (at least one normal step); lower tiers' chunks keep the
        # per-step bound.
        tpot_bound = tpot_margin * max(tight, pace if pace is not None else 0.0)
    chunks = _take_chunks(view, budget, seconds, base, free, room, MIN_CHUNK_TOKENS,
                          uncapped=None if uncapped_tier is None else (lambda r: tpot_bound))
    shape = base
    for rid, n in chunks:
        c = view.local[rid].num_computed
        shape = StepShape(shape.prefill_tokens + n, shape.prefill_attention + n * (c + n / 2),
                          shape.num_decodes, shape.decode_context)
    return StepPlan(tuple([d.req.req_id for d in batch]), tuple(chunks), tuple(victims),
                    tuple(swap), _predicted_s(view, shape, batch) if chunks or batch else 0.0)


def _pace(batch: Sequence[LocalRequest], tpot_by_tier: Sequence[float | None],
          now: float) -> float | None:
    """The time left before the furthest-behind decode of ``batch`` with a TPOT target
    falls behind its mean pace (None: no such decode has its first token yet)."""
    pace: float | None = None
    for d in batch:
        t = tpot_by_tier[d.req.tier]
        ft = d.req.first_token_time
        if t is not None and ft is not None:
            left = ft + t * max(d.req.num_output_tokens, 1) - now
            pace = left if pace is None else min(pace, left)
    return pace


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    """A worker's engine limits, as the step planner honours them."""

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunk_tokens: int


class WorkerScheduler:
    """The step-level kernel of one worker (see the module docstring)."""

    @classmethod
    def with_limits(cls, worker: WorkerInfo, policy: SchedulingPolicy, costs: StepCosts,
                    limits: WorkerLimits) -> WorkerScheduler:
        return cls(worker, policy, costs, block_size=limits.block_size,
                   max_num_seqs=limits.max_num_seqs,
                   max_num_batched_tokens=limits.max_num_batched_tokens,
                   chunk_tokens=limits.chunk_tokens)

    def __init__(self, worker: WorkerInfo, policy: SchedulingPolicy, costs: StepCosts, *,
                 block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 chunk_tokens: int, num_decode_steps: int = 1,
                 on_pick: OnPick | None = None) -> None:
        """``on_pick``: called with each selection a plan makes (who was picked, who was
        passed over), during ``plan``; None records nothing."""
        if num_decode_steps < 1:
            raise ValueError(f"num_decode_steps: must be >= 1, got {num_decode_steps}")
        self.worker = worker
        self.policy = policy
        self.costs = costs
        tiers = getattr(policy, "tiers", None)
        self.anti_thrash_s = tiers.anti_thrash_s if tiers is not None else 1.0
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_tokens = chunk_tokens
        self.num_decode_steps = num_decode_steps
        self.on_pick = on_pick
        self.queue: WaitQueue = policy.make_queue()
        self.local: dict[str, LocalRequest] = {}
        self.decoding: dict[str, LocalRequest] = {}
        self.swapped: dict[str, LocalRequest] = {}
        self._inflight: dict[str, int] = {}  # planned chunks not yet committed
        self._holds: dict[str, tuple[int, float]] = {}  # arrival -> (blocks, until)
        self.num_steps = 0

    # -- membership ------------------------------------------------------------------

    def add_prefill(self, req: Request, num_tokens: int, now: float, *,
                    num_computed: int = 0) -> LocalRequest:
        """``req`` computes ``num_tokens`` here after ``num_computed`` existing ones."""
        lr = LocalRequest(req, num_target=num_computed + num_tokens, num_computed=num_computed)
        self.local[req.req_id] = lr
        self.queue.push(req, now)
        return lr

    def add_decode(self, req: Request, num_context: int, num_blocks: int) -> LocalRequest:
        """A request whose KV (``num_context`` tokens) sits in ``num_blocks`` here decodes."""
        lr = LocalRequest(req, num_context, num_context, num_blocks)
        self.local[req.req_id] = lr
        self.decoding[req.req_id] = lr
        return lr

    def recompute(self, req_id: str, now: float) -> None:
        """A decoding or swapped request lost its KV here: it is prefilled again (prompt +
        output so far) on this worker before it decodes on."""
        lr = self.decoding.pop(req_id, None) or self.swapped.pop(req_id, None)
        if lr is None:
            return
        lr.is_swapped = False
        lr.num_target = lr.num_computed + 1  # every token so far, the last one included
        lr.num_computed = 0
        lr.num_blocks = 0
        lr.req.num_computed_tokens = 0
        self.queue.push(lr.req, now)

    def remove(self, req_id: str) -> LocalRequest | None:
        lr = self.local.pop(req_id, None)
        self.decoding.pop(req_id, None)
        self.swapped.pop(req_id, None)
        self.queue.remove(req_id)
        self._inflight.pop(req_id, None)
        return lr

    def swap_out(self, req_id: str) -> None:
        lr = self.decoding.pop(req_id, None)
        if lr is not None:
            lr.is_swapped = True
            self.swapped[req_id] = lr

    def swapped_in(self, req_id: str, num_blocks: int) -> None:
        lr = self.swapped.pop(req_id, None)
        if lr is not None:
            lr.is_swapped = False
            lr.num_blocks = num_blocks
            self.decoding[req_id] = lr

    def hold_for(self, req_id: str, num_blocks: int, now: float) -> None:
        """A preemption freed ``num_blocks`` here for ``req_id``: keep them for it (else
        the victim would swap straight back in before the arrival is placed)."""
        if num_blocks > 0:
            self._holds[req_id] = (num_blocks, now + HOLD_S)

    def release_hold(self, req_id: str) -> None:
        """``req_id`` arrived (or went elsewhere): its held blocks are plain free ones."""
        self._holds.pop(req_id, None)

    def num_held(self, now: float) -> int:
        for rid in [r for r, (_, until) in self._holds.items() if until <= now]:
            del self._holds[rid]
        return sum(n for n, _ in self._holds.values())

    def has_work(self) -> bool:
        return bool(self.decoding or len(self.queue) or self.swapped or self._inflight)

    @property
    def num_waiting_prefill_tokens(self) -> int:
        return sum(lr.num_prefill_left for lr in self.local.values() if lr.num_prefill_left)

    # -- stepping --------------------------------------------------------------------

    def plan(self, now: float, num_free_blocks: int, *,
             num_free_swap_blocks: int | None = None) -> StepPlan:
        """The next step; ``num_free_swap_blocks``: room left in the worker's host swap
        space (None: unbounded)."""
        if self._holds:
            num_free_blocks = max(0, num_free_blocks - self.num_held(now))
        view = StepView(now, self.worker, list(self.decoding.values()), self.queue, self.local,
                        list(self.swapped.values()), num_free_blocks, self.block_size,
                        self.costs, self.max_num_seqs, self.max_num_batched_tokens,
                        self.chunk_tokens, num_decode_steps=self.num_decode_steps,
                        anti_thrash_s=self.anti_thrash_s,
                        picks=None if self.on_pick is None else [],
                        num_free_swap_blocks=num_free_swap_blocks)
        plan = self.policy.compose_step(view)
        if view.picks:
            for pick in view.picks:
                self.on_pick(pick)  # type: ignore[misc]
        for rid, n in plan.chunks:
            self._inflight[rid] = n
        return plan

    def commit(self, plan: StepPlan, now: float, *, seconds: float | None,
               refused: Sequence[str] = (), blocks: dict[str, int] | None = None,
               computed: dict[str, int] | None = None, decodes_here: bool = True) -> list[str]:
        """Advance the plan's requests after the engine ran it. ``refused``: work the
        engine could not run (chunks go back to the queue, decodes stay). ``blocks``: each
        request's blocks after the step; ``computed``: its tokens with KV after the step
        (the engine's truth, e.g. after prefix-cache hits; default: as planned). Each
        decode advances by its tokens of the step (``num_decode_steps`` iterations, fewer
        at its end); ``seconds`` trains the cost model only for single-iteration steps,
        whose shape is what the model's features describe. Returns the requests whose
        prefill finished in this step."""
        shape_chunks: list[tuple[int, int]] = []
        done: list[str] = []
        refused_set = set(refused)
        for rid, n in plan.chunks:
            self._inflight.pop(rid, None)
            lr = self.local.get(rid)
            if lr is None:
                continue
            if rid in refused_set:
                self.queue.push(lr.req, now)
                continue
            shape_chunks.append((n, lr.num_computed))
            lr.num_computed = computed[rid] if computed and rid in computed else lr.num_computed + n
            lr.req.num_computed_tokens = lr.num_computed
            if lr.num_prefill_left > 0:
                self.queue.push(lr.req, now)
                continue
            lr.num_target = lr.num_computed
            done.append(rid)
            # The step that ends the prompt samples the next token (the first, or the
            # next after a recompute of prompt + output).
            if lr.req.first_token_time is None:
                lr.req.first_token_time = now
            lr.req.num_output_tokens += 1
            if decodes_here:
                self.decoding[rid] = lr
        contexts = []
        multi = self.num_decode_steps > 1
        for rid in plan.decodes:
            lr = self.local.get(rid)
            if lr is None or rid in refused_set:
                continue
            n = decode_tokens(lr, self.num_decode_steps) if multi else 1
            contexts.append(lr.num_computed + 1)
            lr.num_computed += n
            lr.num_target = lr.num_computed
            lr.req.num_output_tokens += n
        if blocks:
            for rid, n in blocks.items():
                lr = self.local.get(rid)
                if lr is not None:
                    lr.num_blocks = n
        if seconds is not None and self.num_decode_steps == 1 and (shape_chunks or contexts):
            self.costs.observe(StepShape.of(shape_chunks, contexts), seconds)
        self.num_steps += 1
        return done


def is_started(req: Request) -> bool:
    """A prefill that has begun (the budget step's queues put these first)."""
    return req.state is RequestState.PREFILLING and req.num_computed_tokens > 0


__all__ = ["LocalRequest", "StepPlan", "StepView", "WorkerLimits", "WorkerScheduler",
           "compose_budget_step", "compose_slo_step", "decode_tokens", "MIN_CHUNK_TOKENS",
           "PreemptMode", "is_started"]

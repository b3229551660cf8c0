"""Discrete-event simulator: a trace through the cluster's own scheduler objects.

The kernel decides and the simulator carries out (DESIGN §2): one
:class:`~scheduler.cluster_scheduler.ClusterScheduler` makes every global decision
(admission, the wait queue, placement, decode reservations, the dispatch horizon,
preemption for arrivals, the request state machine) and one
:class:`~scheduler.step_planner.WorkerScheduler` per simulated worker makes every step
decision: the objects the serving path runs. The simulator owns the clock and the event
queue, applies their plans to the simulated workers (:mod:`scheduler.sim.workers`) and
feeds the results back, as the global scheduler actor and the workers do. RPCs take no
time.

Data flow, each hop a message of the live cluster:

1. arrival: ``ClusterScheduler.submit`` gets what a router sends: the prompt's length
   and block hashes and the ``max_tokens`` budget. The trace's output length stays in
   the simulator: the simulated decode ends there (EOS); the kernel never sees it.
2. after the events of each instant: the workers' reports (prefill workers first), then
   ``plan`` and its orders: a dispatch reserves the blocks on the decode worker (its
   answer goes back at once) and starts the prefill on the prefill worker, or on the
   decode worker itself; a preempt order reaches the decode worker before its next
   step; an abort drops the request where it is. Then every idle worker plans a step.
3. a step ends: the worker commits it (its StepCosts learn the step's time) and reports.
4. a prefill ends: the first token is out, the KV moves to the decode worker in the
   time ``LinkCosts`` gives the pair's topology class, and it decodes there.
5. every control interval: the KV-budget and shares invariants (the cluster scheduler
   ticks its policy inside ``plan``).

Pool modes: ``disaggregated`` (the cluster spec's prefill and decode pools), ``auto``
(the same, and the decode workers may prefill short prompts themselves) and
``aggregated`` (every worker of the spec prefills and decodes; no prefix cache there).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from scheduler.cluster_scheduler import ClusterScheduler, NewRequest, Plan, PoolMode
from scheduler.invariants import Violation, check_kv_budget, check_shares
from scheduler.policies import make_policy
from scheduler.policy import PolicyContext
from scheduler.request import DecisionRecord, Request, RequestState
from scheduler.sim.cluster import ClusterSpec
from scheduler.sim.costmodel import CostModel
from scheduler.sim.slo import SloBars, is_feasible, met_slo
from scheduler.sim.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest
from scheduler.sim.workers import DecodeWorker, Held, PrefillWorker, SimWorker
from scheduler.step_costs import StepCosts
from scheduler.step_planner import WorkerScheduler
from scheduler.tiers import TierConfig
from scheduler.topology import WorkerInfo, WorkerRole

ARRIVAL, STEP_DONE, TRANSFER_DONE, TICK = range(4)
# A request's max_tokens when the trace gives none (every trace here): a generous cap
# above the longest output of the Azure and Mooncake traces (1,000 and 2,000 tokens).
DEFAULT_MAX_TOKENS = 2048
# Share of a prefill worker's KV blocks its prefix cache may use.
PREFIX_CACHE_FRACTION = 0.9
# Rounds of (reports, plan, start steps) per instant before the next event.
MAX_DRIVE_ROUNDS = 4
# Live requests and nothing moved for this long: the kernel deadlocked.
STALL_S = 3600.0
# Every this many control intervals a worker's report lists every request it holds; the
# others list those whose figures changed (exact here: nothing is lost on the way).
COMPLETE_REPORT_TICKS = 10


class SimulationStalled(RuntimeError):
    """Requests are live but nothing has moved for ``STALL_S`` simulated seconds."""


class _Missed(Exception):
    """A tier missed more requests than its attainment bar allows: the verdict is in."""


@dataclass(slots=True)
class Job:
    """One trace request: what the model will produce, and the cluster's request."""

    trace: TraceRequest
    # Tokens the client gets: where the model emits EOS, capped by max_tokens.
    num_output_tokens: int
    is_length: bool  # it ends at max_tokens (finish "length"), not at EOS
    req: Request | None = None  # the ClusterScheduler's request, once submitted


class _Observer:
    """The cluster scheduler's observer: the simulator learns which requests ended."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim

    def on_decision(self, rec: DecisionRecord, tier: int) -> None:
        pass

    def on_closed(self, req: Request) -> None:
        self.sim._closed(req)

    def on_prefix_lookup(self, num_blocks: int, num_hit: int) -> None:
        pass


class Simulator:
    def __init__(self, trace: Sequence[TraceRequest], policy_name: str, cluster: ClusterSpec,
                 cost: CostModel, tiers: TierConfig, *,
                 mode: PoolMode = PoolMode.DISAGGREGATED,
                 max_tokens: int = DEFAULT_MAX_TOKENS, prior_scale: float = 1.0,
                 profile_prior: bool = False, stop_below: SloBars | None = None) -> None:
        """Every worker's StepCosts (and the cluster scheduler's before the first report)
        start from its hardware class's generic prior (``scheduler.step_costs``: GPU_PRIOR
        or CPU_PRIOR), as a live worker that was never calibrated, and learn the profile's
        step times from the steps they run; ``profile_prior`` starts them from the
        profile's own linear model instead, and ``prior_scale`` multiplies the prior (tests
        use both to show that the learning, not the prior, decides). ``stop_below``: end the
        run as soon as some tier has missed more requests than these bars allow (the run
        cannot clear them any more; ``stopped_early`` says so), as an SLO-capacity search
        needs only that verdict."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        self.cost = cost
        self.tiers = tiers
        self.bs = cost.block_size
        self.mode = mode
        self.max_tokens = max_tokens
        self.policy_label = policy_name
        self.trace = list(trace)
        p = cost.profile
        chunk = p.prefill_chunk_tokens

        def prior(prefill_only: bool) -> tuple[float, ...]:
            base = cost.step_prior(prefill_only) if profile_prior else cost.generic_prior()
            return tuple(c * prior_scale for c in base)

        self.cs = ClusterScheduler(tiers, policy_name, self.bs, cost.links, mode=mode,
                                   cost_prior=prior(False), chunk_tokens=chunk,
                                   observer=_Observer(self))
        self.policy = self.cs.policy

        def planner(info: WorkerInfo, prefill_only: bool) -> WorkerScheduler:
            # Each worker builds its own policy over its own learned costs, as a live one.
            costs = StepCosts(prior(prefill_only), chunk_tokens=chunk)
            policy = make_policy(policy_name, PolicyContext(tiers, costs, cost.links, self.bs))
            return WorkerScheduler(info, policy, costs, block_size=self.bs,
                                   max_num_seqs=p.max_batch, max_num_batched_tokens=chunk,
                                   chunk_tokens=chunk)

        hbt = self.trace[0].hash_block_tokens if self.trace else MOONCAKE_BLOCK_TOKENS
        self.host_tier = cluster.host_cache_gb > 0
        self.prefill: list[PrefillWorker] = []
        self.decode: list[DecodeWorker] = []
        if mode is PoolMode.AGGREGATED:
            decode_infos = [replace(i, role=WorkerRole.DECODE)
                            for i in (*cluster.prefill, *cluster.decode)]
        else:
            decode_infos = list(cluster.decode)
            for info in cluster.prefill:
                hbm_tokens = info.num_kv_blocks * PREFIX_CACHE_FRACTION * self.bs
                host_tokens = cluster.host_cache_gb * 1e9 / p.kv_bytes_per_token
                cap = max(1, int((hbm_tokens + host_tokens) // hbt))
                self.prefill.append(PrefillWorker(info, planner(info, True), cost, cap, hbt,
                                                  self.host_tier))
        for info in decode_infos:
            self.decode.append(DecodeWorker(info, planner(info, False), cost))
        self.workers: list[SimWorker] = [*self.prefill, *self.decode]  # report order
        self.by_id: dict[str, SimWorker] = {w.worker_id: w for w in self.workers}
        for w in self.prefill:
            self.cs.add_worker(w.info, w.info.num_kv_blocks, can_prefill=True, can_decode=False)
        for w in self.decode:
            self.cs.add_worker(w.info, w.info.num_kv_blocks,
                               can_prefill=mode is not PoolMode.DISAGGREGATED, can_decode=True)
        for w in self.workers:  # registration: each worker's step costs, its prior so far
            self.cs.on_report(w.report(), 0.0)

        self.jobs: dict[str, Job] = {}
        for tr in self.trace:
            n = min(tr.output_len, max_tokens)
            self.jobs[tr.req_id] = Job(tr, n, tr.output_len >= max_tokens)
        self.stop_below = stop_below
        self.stopped_early = False
        self.missed_tier: int | None = None  # the tier whose misses stopped the run
        self._misses = [0] * tiers.num_tiers
        counts = [0] * tiers.num_tiers
        for tr in self.trace:
            if self._counts(tr.req_id, tr.prompt_len, tr.tier):
                counts[tr.tier] += 1
        self._allowed = ([stop_below.allowed_misses(t, n) for t, n in enumerate(counts)]
                         if stop_below is not None else [])
        self._hash_parts: dict[int, tuple[int, ...]] = {}
        self.violations: list[Violation] = []
        # (time, request, decode worker, prefill worker or None) per applied dispatch.
        self.dispatch_log: list[tuple[float, str, str, str | None]] = []
        self.now = 0.0
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._unfinished = len(self.trace)
        self._last_progress = 0.0
        # Something reached the cluster scheduler since its last plan.
        self._kicked = True
        self._num_ticks = 0
        self.wall_s = 0.0

    @property
    def num_preemptions(self) -> int:
        return self.cs.num_preemptions

    # -- the wire ----------------------------------------------------------------------

    def kv_block_hashes(self, tr: TraceRequest) -> tuple[int, ...]:
        """The prompt's full KV blocks' hashes, as a router computes them: each of the
        trace's prefix ids (``hash_block_tokens`` tokens) stands for that many tokens'
        blocks, numbered within it (equal ids, equal prefix: equal block hashes)."""
        if not tr.hashes:
            return ()
        per = max(1, tr.hash_block_tokens // self.bs)
        num_full = tr.prompt_len // self.bs
        out: list[int] = []
        for h in tr.hashes:
            parts = self._hash_parts.get(h)
            if parts is None:
                parts = self._hash_parts[h] = tuple(h * per + i for i in range(per))
            out.extend(parts)
            if len(out) >= num_full:
                break
        return tuple(out[:num_full])

    def new_request(self, tr: TraceRequest) -> NewRequest:
        """What the router submits for ``tr``."""
        return NewRequest(tr.req_id, tr.tier, tr.arrival, tr.prompt_len, self.max_tokens,
                          self.kv_block_hashes(tr))

    def _wire_copy(self, nr: NewRequest) -> Request:
        """A worker's own request, built from what the dispatch carries."""
        return Request(nr.req_id, nr.tier, nr.arrival_time, nr.prompt_len, nr.max_new_tokens,
                       block_hashes=nr.block_hashes, state=RequestState.PREFILLING)

    # -- the event loop ----------------------------------------------------------------

    def _at(self, t: float, kind: int, obj: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, obj))

    def run(self) -> Simulator:
        t0 = time.perf_counter()
        for job in self.jobs.values():
            self._at(job.trace.arrival, ARRIVAL, job)
        if self.trace:
            self._at(self.trace[0].arrival, TICK, None)
        handlers = {ARRIVAL: self._on_arrival, STEP_DONE: self._on_step_done,
                    TRANSFER_DONE: self._on_transfer_done, TICK: self._on_tick}
        events = self._events
        try:
            while events:
                t, _, kind, obj = heapq.heappop(events)
                self.now = t
                handlers[kind](obj)
                if not events or events[0][0] > t:
                    self._drive()
            self._deliver()
        except _Missed:
            self.stopped_early = True  # the kernel's state is left mid-call: read no more
        self.wall_s = time.perf_counter() - t0
        return self

    def _drive(self) -> None:
        """Reports in, the cluster's plan out and applied, idle workers stepping. The
        cluster plans when something reached it (a submission, a report, an answer) or
        the control interval ticked, as the global scheduler's plan loop is woken."""
        for _ in range(MAX_DRIVE_ROUNDS):
            self._deliver()
            if self._kicked:
                self._kicked = False
                self._apply(self.cs.plan(self.now))
            self._start_idle()
            if not self._kicked and not any(w.has_news for w in self.workers):
                return
        self._deliver()

    def _deliver(self) -> None:
        for w in self.workers:
            if w.has_news:
                self.cs.on_report(w.report(), self.now)
                self._kicked = True
            for rid in w.refused_orders:
                self.cs.on_preempt_result(rid, w.worker_id, False)
            w.refused_orders.clear()

    def _start_idle(self) -> None:
        for w in self.workers:
            if not w.is_busy and w.has_work:
                end = w.begin_step(self.now)
                if end is not None:
                    self._at(end, STEP_DONE, (w, w.version))

    def _cut(self, w: SimWorker) -> None:
        end = w.cut(self.now)
        if end is not None:
            self._at(end, STEP_DONE, (w, w.version))

    # -- applying the plan -------------------------------------------------------------

    def _apply(self, plan: Plan) -> None:
        now = self.now
        for a in plan.aborts:
            for wid in a.worker_ids:
                w = self.by_id[wid]
                w.drop(a.req_id, now)
                self._cut(w)
        for p in plan.preempts:
            dw = self.by_id[p.worker_id]
            assert isinstance(dw, DecodeWorker)
            dw.order(p)
            self._cut(dw)
        for d in plan.dispatches:
            job = self.jobs[d.req_id]
            nr = self.new_request(job.trace)
            dw = self.by_id[d.decode_worker_id]
            assert isinstance(dw, DecodeWorker)
            ok = dw.reserve(Held(self._wire_copy(nr), job.num_output_tokens, job.is_length),
                            d.num_blocks, d.prefill_worker_id, now)
            self.dispatch_log.append((now, d.req_id, d.decode_worker_id, d.prefill_worker_id))
            self.cs.on_dispatch_result(d.req_id, ok, now, num_free_blocks=dw.account.num_free)
            self._kicked = True
            if not ok:
                continue
            if d.prefill_worker_id is None:
                self._cut(dw)
                continue
            pw = self.by_id[d.prefill_worker_id]
            assert isinstance(pw, PrefillWorker)
            pw.start_prefill(Held(self._wire_copy(nr), job.num_output_tokens, job.is_length,
                                  decode_worker_id=dw.worker_id, move_class=d.move_class),
                             job.trace.hashes, now)

    # -- events ------------------------------------------------------------------------

    def _on_arrival(self, job: Job) -> None:
        tr = job.trace
        self._last_progress = self.now
        self._kicked = True
        self.cs.submit(self.new_request(tr), self.now)
        job.req = self.cs.get(tr.req_id) or job.req  # a rejected one came via on_closed

    def _closed(self, req: Request) -> None:
        job = self.jobs.get(req.req_id)
        if job is not None:
            job.req = req
            self._unfinished -= 1
            self._last_progress = self.now
            if (self._allowed and self._counts(req.req_id, req.prompt_len, req.tier)
                    and not met_slo(req, job.num_output_tokens, self.tiers[req.tier])):
                self._misses[req.tier] += 1
                if self._misses[req.tier] > self._allowed[req.tier]:
                    self.missed_tier = req.tier
                    raise _Missed

    def _counts(self, req_id: str, prompt_len: int, tier: int) -> bool:
        """Whether the request counts towards ``stop_below``'s bars (all, or the feasible)."""
        bars = self.stop_below
        return bars is not None and (not bars.feasible_only or is_feasible(
            prompt_len, self.tiers[tier], self.cost.prefill_s))

    def _on_step_done(self, arg: tuple[SimWorker, int]) -> None:
        w, version = arg
        if version != w.version or not w.is_busy:
            return  # a step that was cut short ends at its new time
        self._last_progress = self.now
        done = w.finish_step(self.now)
        if isinstance(w, PrefillWorker):
            for rid in done:
                self._prefilled(w, rid)

    def _prefilled(self, pw: PrefillWorker, req_id: str) -> None:
        """The first token is out: the decode worker hears it, then the KV moves there."""
        h = pw.held[req_id]
        dw = self.by_id[h.decode_worker_id or ""]
        assert isinstance(dw, DecodeWorker)
        if dw.prefilled(req_id, self.now):
            pw.release_kv(req_id)
            return
        dt = self.cost.links.move_s(dw.account.blocks_of(req_id), h.move_class)
        self._at(self.now + dt, TRANSFER_DONE, (pw, dw, req_id))

    def _on_transfer_done(self, arg: tuple[PrefillWorker, DecodeWorker, str]) -> None:
        pw, dw, req_id = arg
        pw.release_kv(req_id)
        dw.kv_arrived(req_id, self.now)
        self._cut(dw)

    def _on_tick(self, _: object) -> None:
        self._kicked = True  # the plan loop's control interval
        self._num_ticks += 1
        complete = self._num_ticks % COMPLETE_REPORT_TICKS == 0
        for w in self.workers:
            w.report_due = True
            w.complete_due = w.complete_due or complete
        self.violations.extend(check_kv_budget(w.account for w in self.workers))
        self.violations.extend(check_shares(self.policy.shares))
        if self.cs.live and self.now - self._last_progress > STALL_S:
            raise SimulationStalled(
                f"{len(self.cs.live)} live requests, nothing moved since "
                f"t={self._last_progress:.1f}s (now {self.now:.1f}s)")
        if self._unfinished > 0:
            self._at(self.now + self.tiers.control_interval_s, TICK, None)

"""Discrete-event simulator: a trace through the real kernel against a cost model.

Data flow per request (the same decisions a live cluster asks the kernel for):

1. arrival: ``policy.admit`` (reject ends it), ``policy.place_prefill`` picks a
   prefill worker (prefix match from that worker's index + queued work).
2. prefill step (chunked, ``prefill_chunk_tokens`` per step): the worker's wait
   queue offers requests in policy order; starting one pins its cached prefix
   and reserves its decode blocks (``policy.place_decode``; failing that,
   ``policy.preempt_for`` may preempt, else the request is skipped or, for
   strict-FCFS peers, the step stops there). The first token comes out of prefill.
3. transfer: blocks move to the decode worker, priced by topology class.
4. decode: continuous batching in macro-steps of up to ``K_MAX`` identical
   steps (cut short when a request joins or finishes); blocks grow one block
   per ``block_size`` tokens; when they run out, ``policy.on_kv_pressure``
   picks victims (swap, recompute or migrate); a request whose next block is
   not there and that no eligible victim can make room for sits the step out.
5. every control interval: ``policy.tick`` (deadline watcher, fair share) and
   the KV-budget and share invariants.

Every state change goes through :func:`scheduler.request.transition`, so the
records the invariants check are the ones a live cluster would produce.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Collection, Iterator, Sequence

from scheduler.admission import AdmissionKind, LoadSnapshot, kv_release_rate
from scheduler.invariants import Violation, check_kv_budget, check_shares
from scheduler.kv import KVBlockAccount
from scheduler.placement import DecodeView, PrefillView
from scheduler.policies import make_policy
from scheduler.policy import PolicyContext, SchedulingPolicy
from scheduler.preemption import PreemptionPlan, PreemptMode, Victim, VictimView
from scheduler.prefix_index import PrefixIndex
from scheduler.queues import Verdict
from scheduler.request import Decision, Request, RequestState, transition
from scheduler.sim.cluster import ClusterSpec
from scheduler.sim.costmodel import CostModel
from scheduler.sim.traces import TraceRequest
from scheduler.sim.workers import DecodeWorker, Job, PrefillWorker
from scheduler.tiers import TierConfig
from scheduler.topology import TopologyClass

S = RequestState
K_MAX = 16
ARRIVAL, PREFILL_DONE, TRANSFER_DONE, DECODE_DONE, TICK, RESUME = range(6)
# Share of a prefill worker's KV blocks its prefix cache may use.
PREFIX_CACHE_FRACTION = 0.9


class Simulator:
    def __init__(self, trace: Sequence[TraceRequest], policy_name: str, cluster: ClusterSpec,
                 cost: CostModel, tiers: TierConfig) -> None:
        self.cost = cost
        self.tiers = tiers
        self.bs = cost.block_size
        self.policy_label = policy_name
        self.policy: SchedulingPolicy = make_policy(
            policy_name, PolicyContext(tiers, cost, cost.links, self.bs))
        self.trace = list(trace)
        self.prefill: list[PrefillWorker] = []
        for info in cluster.prefill:
            hbt = self.trace[0].hash_block_tokens if self.trace else 512
            hbm_tokens = info.num_kv_blocks * PREFIX_CACHE_FRACTION * self.bs
            host_tokens = cluster.host_cache_gb * 1e9 / cost.profile.kv_bytes_per_token
            cap = max(1, int((hbm_tokens + host_tokens) // hbt))
            self.prefill.append(PrefillWorker(info, self.policy.make_queue(), PrefixIndex(cap),
                                              [0.0] * tiers.num_tiers))
        self.decode = [DecodeWorker(i, KVBlockAccount(i.worker_id, i.num_kv_blocks))
                       for i in cluster.decode]
        # With a host tier, every prefix hit is charged a host-to-device copy (a
        # conservative price: some hits are really still in HBM).
        self.host_tier = cluster.host_cache_gb > 0
        self.jobs: dict[str, Job] = {}
        self.done: list[Job] = []
        self.violations: list[Violation] = []
        self.now = 0.0
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._unfinished = 0
        self.num_preemptions = 0
        self.wall_s = 0.0
        self._kv_queued = [0] * tiers.num_tiers  # decode blocks queued jobs wait for

    # -- event plumbing -------------------------------------------------------
    def _at(self, t: float, kind: int, obj: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, obj))

    def run(self) -> Simulator:
        t0 = time.perf_counter()
        for tr in self.trace:
            req = Request(tr.req_id, tr.tier, tr.arrival, tr.prompt_len, tr.output_len,
                          block_hashes=tr.hashes)
            job = Job(req, tr, ctx_target=tr.prompt_len)
            self.jobs[tr.req_id] = job
            self._at(tr.arrival, ARRIVAL, job)
        self._unfinished = len(self.trace)
        if self.trace:
            self._at(self.trace[0].arrival, TICK, None)
        handlers = {ARRIVAL: self._on_arrival, PREFILL_DONE: self._on_prefill_done,
                    TRANSFER_DONE: self._on_transfer_done, DECODE_DONE: self._on_decode_done,
                    TICK: self._on_tick, RESUME: self._on_resume}
        events = self._events
        while events:
            t, _, kind, obj = heapq.heappop(events)
            self.now = t
            handlers[kind](obj)
        self.wall_s = time.perf_counter() - t0
        return self

    def _record(self, job: Job, to: RequestState, decision: Decision, why: str,
                mem: float = 0.0, hit: int = 0, blocking: str | None = None) -> None:
        transition(job.req, to, decision=decision, triggered_by=why, now=self.now,
                   mem_pressure=mem, kv_reuse_hit=hit, blocking_req_id=blocking)

    # -- arrival and prefill ---------------------------------------------------
    def _load(self) -> LoadSnapshot:
        n = self.tiers.num_tiers
        backlog = [sum(w.backlog[t] for w in self.prefill) for t in range(n)]
        queued = list(self._kv_queued)
        held = [0] * n
        pairs = []
        for dw in self.decode:
            for j in itertools.chain(dw.running.values(), dw.pending):
                held[j.req.tier] += j.num_blocks
                pairs.append((j.num_blocks, j.req.max_new_tokens))
            for j in dw.swapped:
                queued[j.req.tier] += j.num_blocks
        return LoadSnapshot(backlog, len(self.prefill), any(not w.busy for w in self.prefill),
                            queued, held, sum(d.account.num_free for d in self.decode),
                            kv_release_rate(pairs, self.cost.decode_token_s()), self.bs)

    def _want_kv(self, job: Job, blocks: int) -> None:
        """Count (blocks > 0) or uncount (0) the decode blocks a queued job waits for."""
        self._kv_queued[job.req.tier] += blocks - job.kv_wanted
        job.kv_wanted = blocks

    def _on_arrival(self, job: Job) -> None:
        req = job.req
        self.policy.record_demand(req.tier, req.prompt_len + req.max_new_tokens, self.now)
        decision = self.policy.admit(req, self.now, self._load())
        if decision.kind is AdmissionKind.REJECT:
            self._record(job, S.REJECTED, Decision.REJECT, decision.reason.value)
            self._finish(job)
            return
        self._place_prefill(job)

    def _place_prefill(self, job: Job) -> None:
        req = job.req
        views = [PrefillView(w.info, w.backlog_s, w.index.match_len(req.block_hashes)
                             if w.index is not None and req.block_hashes else 0)
                 for w in self.prefill]
        hbt_blocks = max(1, job.trace.hash_block_tokens // self.bs)
        views = [PrefillView(v.info, v.backlog_s, v.match_blocks * hbt_blocks, tuple(w.backlog))
                 for v, w in zip(views, self.prefill, strict=True)]
        chosen = self.policy.place_prefill(req, views)
        pw = next(w for w in self.prefill if chosen is not None and w.info == chosen.info)
        job.prefill = pw
        job.started = False
        job.queued_est = self.cost.prefill_s(max(job.ctx_target - req.num_computed_tokens, 1),
                                             req.num_computed_tokens)
        pw.backlog[req.tier] += job.queued_est
        self._want_kv(job, -(-(job.ctx_target + 1) // self.bs))
        pw.queue.push(req, self.now)
        if not pw.busy:
            self._start_prefill(pw)

    def _begin(self, pw: PrefillWorker, job: Job, failed: dict[int, int]) -> Verdict:
        """Start a request's prefill here: reserve decode blocks, pin its prefix.

        ``failed`` maps tier -> smallest block need that found no decode room in
        this step: a request of that or a lower tier needing as much fails too.
        """
        req = job.req
        need = -(-(job.ctx_target + 1) // self.bs)
        blocked = any(t <= req.tier and n <= need for t, n in failed.items())
        dw = None if blocked else self._reserve_decode(job, need, pw)
        if dw is None:
            failed[req.tier] = min(need, failed.get(req.tier, need))
            return Verdict.SKIP if self.policy.skips_blocked else Verdict.STOP
        hits = 0
        if pw.index is not None and req.block_hashes:
            got = pw.index.acquire(req.block_hashes, lambda: self._protected(pw))
            if got is None:
                self._release_decode(job)
                self._want_kv(job, need)
                return Verdict.SKIP
            hits = got
            job.num_pinned = len(req.block_hashes)
            pw.accesses.append(req.block_hashes)
        cached = min(hits * job.trace.hash_block_tokens, job.ctx_target - 1)
        if self.host_tier and cached > req.num_computed_tokens:
            job.num_loaded_blocks = -(-(cached - req.num_computed_tokens) // self.bs)
        req.num_computed_tokens = max(req.num_computed_tokens, cached)
        job.started = True
        self._record(job, S.PREFILLING, Decision.SCHEDULE_PREFILL, "prefill_step",
                     mem=dw.account.mem_pressure, hit=hits * job.trace.hash_block_tokens // self.bs)
        return Verdict.TAKE

    def _protected(self, pw: PrefillWorker) -> Collection[int]:
        """Hashes prefixing waiting requests worth keeping, computed once per step."""
        if pw.protected is None:
            pw.protected = self.policy.protected_hashes(pw.queue.requests())
        return pw.protected

    def _reserve_decode(self, job: Job, need: int, pw: PrefillWorker) -> DecodeWorker | None:
        views = [DecodeView(d.info, d.account.num_free, len(d.running)) for d in self.decode]
        choice = self.policy.place_decode(job.req, need, views, pw.info)
        if choice is None:
            def soon_free(d: DecodeWorker) -> int:
                return d.account.num_free + sum(v.num_blocks for _, v in d.doomed)  # type: ignore[attr-defined]

            target = max(self.decode, key=soon_free)
            if soon_free(target) >= need and target.doomed:
                return None  # victims already chosen free enough at the end of this step
            plan = self.policy.preempt_for(job.req, need, soon_free(target),
                                           self._victim_views(target), self.now)
            if plan is not None:
                self._doom(target, plan, job.req.req_id)
            return None
        dw = next(d for d in self.decode if d.info == choice.view.info)
        if not dw.account.allocate(job.req.req_id, need):
            return None
        job.decode = dw
        job.num_blocks = need
        job.move_class = choice.move_class
        self._want_kv(job, 0)
        return dw

    def _start_prefill(self, pw: PrefillWorker) -> None:
        pw.busy = True  # deciding: a wake-up from inside this step must not re-enter
        pw.protected = None
        budget = [self.policy.prefill_step_tokens(self.cost.profile.prefill_chunk_tokens)]
        batch: list[tuple[Job, int]] = []
        failed: dict[int, int] = {}
        cost = self.cost
        step_s = self.policy.prefill_step_seconds()
        flops_left: list[float | None] = [
            None if step_s is None
            else max(step_s - cost.profile.prefill_overhead_s, 0.0) * cost.flops_rate]

        def accept(req: Request) -> Verdict:
            # A step always takes its first chunk, whatever the time budget says.
            if budget[0] <= 0 or (flops_left[0] is not None and flops_left[0] <= 0 and batch):
                return Verdict.STOP
            job = self.jobs[req.req_id]
            if not job.started:
                v = self._begin(pw, job, failed)
                if v is not Verdict.TAKE:
                    return v
            take = min(job.ctx_target - req.num_computed_tokens, budget[0])
            if flops_left[0] is not None:
                # Long contexts cost more per token: fit the chunk to the time budget.
                per_token = cost.prefill_flops(take, req.num_computed_tokens) / max(take, 1)
                fit = int(flops_left[0] // per_token)
                if fit < take and batch:
                    return Verdict.STOP
                take = max(min(take, fit), min(take, 256))
                flops_left[0] -= cost.prefill_flops(take, req.num_computed_tokens)
            budget[0] -= take
            batch.append((job, take))
            return Verdict.TAKE

        pw.queue.take(self.now, accept)
        if not batch:
            pw.busy = False
            return
        flops = sum(self.cost.prefill_flops(take, j.req.num_computed_tokens) for j, take in batch)
        load_s = sum(self.cost.links.swap_s(j.num_loaded_blocks) for j, _ in batch)
        for j, _ in batch:
            j.num_loaded_blocks = 0
        pw.busy = True
        pw.batch = batch
        self._at(self.now + self.cost.prefill_step_s(flops) + load_s, PREFILL_DONE, pw)

    def _on_prefill_done(self, pw: PrefillWorker) -> None:
        batch, pw.batch = pw.batch, []
        share = 1.0 / max(len(batch), 1)
        for job, take in batch:
            req = job.req
            req.num_computed_tokens += take
            left = job.ctx_target - req.num_computed_tokens
            est = self.cost.prefill_s(left, req.num_computed_tokens) if left > 0 else 0.0
            pw.backlog[req.tier] = max(0.0, pw.backlog[req.tier] + est - job.queued_est)
            job.queued_est = est
            job.num_tokens_served += take
            self.policy.record_served(req.tier, take, share * self.cost.prefill_s(take, 0),
                                      self.now)
            if left > 0:
                pw.queue.push(req, self.now)
                continue
            if job.num_pinned:
                pw.index.release(req.block_hashes)  # type: ignore[union-attr]
                job.num_pinned = 0
            if req.first_token_time is None:
                req.first_token_time = self.now
                req.num_output_tokens = 1
                spec = self.tiers[req.tier]
                if spec.ttft_s is not None:
                    self.policy.observe_latency(req.tier, self.now - req.arrival_time, spec.ttft_s)
            if req.num_output_tokens >= req.max_new_tokens:
                self._record(job, S.FINISHED_LENGTH, Decision.FINISH_LENGTH, "prefill_done")
                self._release_decode(job)
                self._finish(job)
                continue
            self._record(job, S.TRANSFERRING, Decision.START_TRANSFER, "prefill_done")
            dt = self.cost.links.move_s(job.num_blocks, job.move_class)
            self._at(self.now + dt, TRANSFER_DONE, job)
        self._start_prefill(pw)

    def _wake_prefill(self) -> None:
        for pw in self.prefill:
            if not pw.busy and len(pw.queue):
                self._start_prefill(pw)

    # -- decode -----------------------------------------------------------------
    def _on_transfer_done(self, job: Job) -> None:
        self._record(job, S.DECODING, Decision.START_DECODE, "transfer_done")
        dw = job.decode
        assert dw is not None
        dw.pending.append(job)
        self._kick(dw)

    def _kick(self, dw: DecodeWorker) -> None:
        """New work for ``dw``: start a step, or cut the running one at its next step."""
        if not dw.busy:
            self._start_decode(dw)
            return
        done = math.ceil((self.now - dw.step_start) / dw.step_dt - 1e-9) if dw.step_dt > 0 else 1
        done = max(done, 1)
        if done < dw.step_k:
            dw.step_k = done
            dw.version += 1
            self._at(dw.step_start + done * dw.step_dt, DECODE_DONE, (dw, dw.version))

    def _victim_views(self, dw: DecodeWorker) -> list[VictimView]:
        peers = [d for d in self.decode if d is not dw and d.info.domain == dw.info.domain]
        out = []
        for job in dw.running.values():
            if job.req.state is not S.DECODING:
                continue
            peer = next((p.info for p in peers if p.account.num_free >= job.num_blocks * 2), None)
            out.append(VictimView(job.req, dw.info, job.num_blocks, peer=peer))
        return out

    def _doom(self, dw: DecodeWorker, plan: PreemptionPlan, blocking: str | None,
              kick: bool = True) -> None:
        """Mark victims now; their blocks free at the end of the running step."""
        for v in plan.victims:
            job = dw.running.get(v.req_id)
            if job is None or job.req.state is not S.DECODING:
                continue
            decision = {PreemptMode.SWAP: Decision.PREEMPT_SWAP,
                        PreemptMode.RECOMPUTE: Decision.PREEMPT_RECOMPUTE,
                        PreemptMode.MIGRATE: Decision.PREEMPT_MIGRATE}[v.mode]
            self._record(job, S.PREEMPTING, decision, "kv_pressure",
                         mem=dw.account.mem_pressure, blocking=blocking)
            self.num_preemptions += 1
            dw.doomed.append((v.req_id, v))
        if dw.doomed and kick:
            self._kick(dw)

    def _apply_doomed(self, dw: DecodeWorker) -> None:
        doomed, dw.doomed = dw.doomed, []
        for req_id, victim in doomed:
            job = dw.running.pop(req_id, None)
            if job is None:
                continue
            assert isinstance(victim, Victim)
            self._evict(dw, job, victim)
        if doomed:
            self._wake_prefill()

    def _evict(self, dw: DecodeWorker, job: Job, v: Victim) -> None:
        req = job.req
        dw.account.release(req.req_id)
        self._record(job, S.PREEMPTED, Decision.PREEMPT_DONE, "kv_pressure")
        if v.mode is PreemptMode.MIGRATE:
            peer = next((d for d in self.decode if d.info.worker_id == v.peer_id), None)
            if peer is not None and peer.account.allocate(req.req_id, job.num_blocks):
                job.decode = peer
                cls = (TopologyClass.SAME_DOMAIN if peer.info.domain == dw.info.domain
                       else TopologyClass.CROSS_NODE)
                self._at(self.now + self.cost.links.move_s(job.num_blocks, cls), RESUME,
                         (job, Decision.RESUME_MIGRATE))
                return
            v = Victim(v.req_id, PreemptMode.SWAP, v.num_blocks, v.cost)
        if v.mode is PreemptMode.SWAP:
            dw.swapped.append(job)
            return
        self._record(job, S.QUEUED, Decision.RESUME_RECOMPUTE, "recompute")
        job.ctx_target = req.prompt_len + req.num_output_tokens
        req.num_computed_tokens = 0
        job.decode = None
        job.num_blocks = 0
        self._place_prefill(job)

    def _on_resume(self, arg: tuple[Job, Decision]) -> None:
        job, decision = arg
        self._record(job, S.DECODING, decision, "resume")
        assert job.decode is not None
        job.decode.pending.append(job)
        self._kick(job.decode)

    def _release_decode(self, job: Job) -> None:
        if job.decode is not None:
            job.decode.account.release(job.req.req_id)
            job.decode = None

    def _start_decode(self, dw: DecodeWorker) -> None:
        self._apply_doomed(dw)
        cap = self.cost.profile.max_batch
        if dw.pending:
            room = cap - len(dw.running)
            joining = self.policy.order([j.req for j in dw.pending], self.now)[:max(room, 0)]
            ids = {r.req_id for r in joining}
            for job in [j for j in dw.pending if j.req.req_id in ids]:
                dw.running[job.req.req_id] = job
            dw.pending = [j for j in dw.pending if j.req.req_id not in ids]
        if dw.swapped and len(dw.running) < cap:
            for r in self.policy.order([j.req for j in dw.swapped], self.now):
                job = self.jobs[r.req_id]
                if dw.account.allocate(r.req_id, job.num_blocks):
                    dw.swapped.remove(job)
                    self._at(self.now + self.cost.links.swap_s(job.num_blocks), RESUME,
                             (job, Decision.RESUME_SWAP_IN))
                else:
                    break
        if not dw.running:
            dw.busy = False
            return
        batch = self._grow(dw)
        if not batch:
            dw.busy = False
            return
        k = min(K_MAX, min(j.req.max_new_tokens - j.req.num_output_tokens for j in batch))
        ctx = sum(j.req.num_context_tokens for j in batch) + len(batch) * k // 2
        dw.step_dt = self.cost.decode_step_s(len(batch), ctx)
        dw.step_k = max(k, 1)
        dw.step_start = self.now
        dw.batch = batch
        dw.busy = True
        dw.version += 1
        self._at(self.now + dw.step_k * dw.step_dt, DECODE_DONE, (dw, dw.version))

    def _grow(self, dw: DecodeWorker) -> list[Job]:
        """Give every running request the blocks for the next K_MAX tokens, or stall it."""
        jobs = list(dw.running.values())

        def extra(j: Job) -> int:
            return max(0, -(-(j.req.num_context_tokens + K_MAX) // self.bs) - j.num_blocks)

        growers = [j for j in jobs if extra(j) > 0]
        short = sum(extra(j) for j in growers) - dw.account.num_free
        if short > 0:
            top = min(j.req.tier for j in growers)
            plan = self.policy.on_kv_pressure(short, self._victim_views(dw), self.now, top)
            if plan.victims:
                self._doom(dw, plan, None, kick=False)
                self._apply_doomed(dw)
                jobs = list(dw.running.values())
        if not jobs:
            return []
        order = self.policy.order([j.req for j in jobs], self.now)
        batch = []
        for r in order:
            j = dw.running[r.req_id]
            e = extra(j)
            if e == 0 or dw.account.allocate(r.req_id, e):
                j.num_blocks += e
                batch.append(j)
        if not batch:
            # Nothing can grow and no victim was allowed: recompute the last in order
            # that is outside its anti-thrash window (any, if none is).
            window = self.tiers.anti_thrash_s
            outside = [r for r in order if r.last_preempt_time is None
                       or self.now - r.last_preempt_time >= window]
            j = dw.running.pop((outside or order)[-1].req_id)
            self._record(j, S.PREEMPTING, Decision.PREEMPT_RECOMPUTE, "kv_exhausted")
            self.num_preemptions += 1
            self._evict(dw, j, Victim(j.req.req_id, PreemptMode.RECOMPUTE, j.num_blocks, 0.0))
            return self._grow(dw) if dw.running else []
        return batch

    def _on_decode_done(self, arg: tuple[DecodeWorker, int]) -> None:
        dw, version = arg
        if version != dw.version:
            return
        k = dw.step_k
        served = [0] * self.tiers.num_tiers
        for job in dw.batch:
            req = job.req
            if req.state is not S.DECODING and req.state is not S.PREEMPTING:
                continue
            if req.req_id not in dw.running:
                continue
            req.num_output_tokens += k
            job.num_tokens_served += k
            served[req.tier] += k
            if req.num_output_tokens >= req.max_new_tokens:
                if req.state is S.PREEMPTING:  # finished before its preemption took effect
                    self._record(job, S.DECODING, Decision.START_DECODE, "preempt_cancelled")
                del dw.running[req.req_id]
                self._record(job, S.FINISHED_LENGTH, Decision.FINISH_LENGTH, "decode_done")
                dw.account.release(req.req_id)
                job.decode = None
                self._finish(job)
        step_s = k * dw.step_dt
        total = sum(served)
        for t, n in enumerate(served):
            if n:
                self.policy.record_served(t, n, step_s * n / total, self.now)
        dw.busy = False
        self._start_decode(dw)
        self._wake_prefill()

    def _finish(self, job: Job) -> None:
        self._unfinished -= 1
        self.done.append(job)

    # -- control ---------------------------------------------------------------
    def _waiting(self) -> Iterator[Request]:
        for pw in self.prefill:
            yield from pw.queue.requests()

    def _on_tick(self, _: object) -> None:
        self.policy.tick(self.now, self._waiting())
        self.violations.extend(check_kv_budget(d.account for d in self.decode))
        self.violations.extend(check_shares(self.policy.shares))
        # Orderings depend on time (slack shrinks, boosts start): an idle worker
        # that found nothing worth starting must look again, or it waits forever.
        self._wake_prefill()
        for dw in self.decode:
            if not dw.busy and dw.pending:
                self._start_decode(dw)
        if self._unfinished > 0:
            self._at(self.now + self.tiers.control_interval_s, TICK, None)

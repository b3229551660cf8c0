"""Fault drills against a running cluster: kill a part of it mid-stream, check what the
clients see and that the cluster heals (issue 13; ``tierserve drill`` and the tests in
``tests/bench/test_fault_drills.py`` both run :func:`run_drill`).

One drill, in order::

    1. BASELINE  /health ok; the live workers per role; optionally each prompt's greedy
                 answer, undisturbed (to check that a retried stream repeats nothing)
    2. LOAD      ``num_streams`` greedy streaming completions; wait until each is
                 mid-stream. The prefill drill then sends long prompts and waits until
                 the prefill worker is computing them.
    3. FAULT     t = 0: ``ray.kill(no_restart=False)`` the target (a crash: Ray starts it
                 again), SIGSTOP it (a hang: the scheduler must notice and kill it), or
                 kill a router replica (Serve replaces it)
    4. WATCH     the streams run to their end; a short probe request starts every
                 PROBE_INTERVAL_S (each with its own timeout) and says when the service
                 answers again
    5. HEALED    the target is back: a new incarnation of the worker (or scheduler)
                 registered and alive, or a new router replica answering; /health ok
                 with as many live workers as before
    6. IDLE      /metrics: no request running, no KV block in use on any worker; and
                 how many requests the cluster ended with a retryable error meanwhile
                 (their routers retried them): ``scheduler_decisions_total``

A stream ends completed (a finish reason; with references, the text must equal the
undisturbed answer) or failed (an error in the stream, an HTTP error, a broken
connection). What a client in flight must never see is a long silence: from the fault
on, each stream must bring a token, its finish or its error within 10 s of the fault
and of every token after it (``max_gap_s``: a retried stream's gap is the retry, a failed
one's the time to its error; the end of a long, healthy stream comes when it comes, so
``clear_s`` is reported, not judged). :class:`DrillBounds` holds the issue's numbers:
that 10 s, the service answering again within 30 s, no block leaked.

Traffic goes only to ``url`` (``bench/drill_traffic.py``); the faults go through Ray
(``bench/drill_control.py``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.drill_control import ClusterControl, Fault
from bench.drill_traffic import (
    PROBE_INTERVAL_S,
    WATCH_S,
    Endpoint,
    Probe,
    Stream,
    StreamResult,
    completion_body,
    drill_prompt,
    probe_loop,
)

MID_STREAM_CHUNKS = 4
HEAL_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 90.0


@dataclass(frozen=True, slots=True)
class DrillBounds:
    # From the fault on, every stream in flight brings a token, its finish or a clear
    # error within this of the fault and of each of its tokens (never a longer silence).
    gap_s: float = 10.0
    recovery_s: float = 30.0  # the service answers a new request again within this
    leaked_blocks: int = 0


@dataclass(frozen=True, slots=True)
class DrillLoad:
    num_streams: int = 6
    max_tokens: int = 48
    prompt_words: int = 12
    # The prefill drill's long prompts (sent once the streams are mid-stream): longer than
    # pools.auto_local_prefill_max_tokens (1,024), so auto mode sends them to the prefill
    # worker while it lives.
    num_long: int = 1
    long_prompt_words: int = 1100
    long_max_tokens: int = 8
    check_identity: bool = False  # greedy references before the fault (deterministic models)


@dataclass(slots=True)
class DrillResult:
    fault: str
    target: str
    num_streams: int = 0  # in flight at the fault
    num_completed: int = 0
    num_failed: int = 0
    num_unresolved: int = 0
    num_identical: int = 0
    num_compared: int = 0
    clear_s: float | None = None  # when the last stream in flight ended, after the fault
    max_gap_s: float | None = None  # the longest silence a stream saw after the fault
    recovery_s: float | None = None  # when the service answered again (0: never stopped)
    num_probes: int = 0
    num_probe_failures: int = 0
    probe_statuses: dict[str, int] = field(default_factory=dict)
    retry_after_seen: bool = False
    # Requests the cluster ended with worker_failed / transfer_failed during the drill (the
    # router retried them); None where the counters restarted (the scheduler drill).
    num_retried: int | None = None
    healed_s: float | None = None  # when the target was back and /health showed every worker
    idle_s: float | None = None  # when no request ran and no block was held any more
    leaked_blocks: int | None = None
    # This machine's 1-minute load average when the drill began (a busy machine is slow).
    load_avg: float | None = None
    errors: list[str] = field(default_factory=list)
    streams: list[StreamResult] = field(default_factory=list)
    ok: bool = False
    failures: list[str] = field(default_factory=list)

    def judge(self, bounds: DrillBounds) -> DrillResult:
        f = []
        if self.num_unresolved:
            f.append(f"{self.num_unresolved} streams did not end")
        if self.max_gap_s is None or self.max_gap_s > bounds.gap_s:
            f.append(f"a stream was silent {self.max_gap_s} s after the fault "
                     f"(bound {bounds.gap_s})")
        if self.recovery_s is None or self.recovery_s > bounds.recovery_s:
            f.append(f"serving again after {self.recovery_s} s (bound {bounds.recovery_s})")
        if self.leaked_blocks is None or self.leaked_blocks > bounds.leaked_blocks:
            f.append(f"{self.leaked_blocks} KV blocks still held when idle")
        if self.num_compared and self.num_identical != self.num_compared:
            f.append(f"{self.num_compared - self.num_identical} completed streams differ "
                     "from their undisturbed answer")
        self.failures, self.ok = f, not f
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _wait_for(cond, timeout_s: float, interval_s: float = 0.2) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await cond():
            return True
        await asyncio.sleep(interval_s)
    return bool(await cond())


def _live_counts(health: dict[str, Any] | None) -> dict[str, int]:
    return dict((health or {}).get("live_workers") or {})


async def run_drill(url: str, fault: Fault, control: ClusterControl, *,
                    load: DrillLoad | None = None, bounds: DrillBounds | None = None,
                    api_key: str | None = None) -> DrillResult:
    load = load or DrillLoad()
    bounds = bounds or DrillBounds()
    http = Endpoint(url, api_key)
    try:
        return (await _run(http, fault, control, load)).judge(bounds)
    finally:
        await http.close()


async def _run(http: Endpoint, fault: Fault, control: ClusterControl, load: DrillLoad
               ) -> DrillResult:
    # 1. BASELINE
    load_avg = round(os.getloadavg()[0], 2)
    if not await _wait_for(lambda: _healthy(http), 60, 0.5):
        raise RuntimeError(f"{http.url} is not healthy before the drill")
    baseline = _live_counts(await http.health())
    model = await http.model()
    nonce = f"{os.urandom(3).hex()} "
    prompts = [(drill_prompt(i, load.prompt_words, nonce), load.max_tokens, False)
               for i in range(load.num_streams)]
    if fault is Fault.PREFILL:
        prompts += [(drill_prompt(100 + i, load.long_prompt_words, nonce),
                     load.long_max_tokens, True) for i in range(load.num_long)]
    refs: dict[int, str] = {}
    if load.check_identity:
        for i, (prompt, n, _) in enumerate(prompts):
            status, text, _ = await http.complete(completion_body(model, prompt, n, False), 120)
            if status == 200:
                refs[i] = text

    # 2. LOAD
    results = [StreamResult(i, is_long) for i, (_, _, is_long) in enumerate(prompts)]
    short = [i for i, (_, _, is_long) in enumerate(prompts) if not is_long]
    streams: dict[int, Stream] = {}
    for i in short:
        streams[i] = Stream(http, completion_body(model, prompts[i][0], prompts[i][1], True),
                            results[i])
    await _wait_for(lambda: _all_mid_stream(streams), 60, 0.05)
    target = await _pick_target(fault, control)
    if fault is Fault.PREFILL:
        for i, (prompt, n, is_long) in enumerate(prompts):
            if is_long:
                streams[i] = Stream(http, completion_body(model, prompt, n, True), results[i])
        await _wait_for(lambda: _prefilling(control, target), 30, 0.02)
    for i in streams:
        results[i].num_chunks_at_fault = results[i].num_chunks
    before = await control.incarnation(fault, target)
    retried_before = (await http.metrics()).get("retried", 0.0)

    # 3. FAULT
    t0 = time.monotonic()
    stopped_pid = await _inject(fault, control, target)
    probes: list[Probe] = []
    stop = asyncio.Event()
    prober = asyncio.get_running_loop().create_task(probe_loop(http, model, t0, stop, probes))
    try:
        # 4. WATCH
        await asyncio.wait([s.task for s in streams.values()], timeout=WATCH_S)
        # 5. HEALED
        healed = await _wait_for(lambda: _healed(http, control, fault, target, before,
                                                 baseline), HEAL_TIMEOUT_S, 0.25)
        healed_s = time.monotonic() - t0 if healed else None
        await asyncio.sleep(2 * PROBE_INTERVAL_S)  # probes after healing
    finally:
        stop.set()
        await prober
        if stopped_pid is not None:
            _resume(stopped_pid)
    # 6. IDLE
    t_idle = await _wait_idle(http, baseline)

    res = DrillResult(fault.value, target, num_streams=len(streams), healed_s=healed_s,
                      load_avg=load_avg)
    if fault is not Fault.SCHEDULER:  # a restarted scheduler counts from 0
        res.num_retried = int((await http.metrics()).get("retried", 0.0) - retried_before)
    for i, s in streams.items():
        r = results[i]
        r.end_s = None if s.t_end is None or not s.task.done() else round(s.t_end - t0, 3)
        r.in_flight = r.end_s is None or r.end_s > 0
        gap = s.max_gap_after(t0)
        r.max_gap_s = None if gap is None else round(gap, 3)
        if i in refs and r.completed:
            r.identical = r.text == refs[i]
        res.streams.append(r)
    live = [r for r in res.streams if r.in_flight]
    res.num_streams = len(live)
    res.num_completed = sum(r.completed for r in live)
    res.num_unresolved = sum(r.end_s is None for r in live)
    res.num_failed = len(live) - res.num_completed - res.num_unresolved
    res.num_compared = sum(r.identical is not None for r in live)
    res.num_identical = sum(bool(r.identical) for r in live)
    ends = [r.end_s for r in live if r.end_s is not None]
    res.clear_s = round(max(0.0, *ends), 3) if ends and not res.num_unresolved else None
    gaps = [r.max_gap_s for r in live]
    res.max_gap_s = None if not gaps or None in gaps else max(gaps)  # type: ignore[type-var]
    res.errors = sorted({r.error for r in live if r.error})
    _judge_probes(res, probes)
    res.idle_s, res.leaked_blocks = t_idle
    if res.idle_s is not None:
        res.idle_s = round(res.idle_s - t0, 3)
    if res.healed_s is not None:
        res.healed_s = round(res.healed_s, 3)
    return res


async def _healthy(http: Endpoint) -> bool:
    return await http.health() is not None


async def _healed(http: Endpoint, control: ClusterControl, fault: Fault, target: str,
                  before: str, baseline: dict[str, int]) -> bool:
    if not await control.is_back(fault, target, before):
        return False
    h = await http.health()
    return h is not None and all(_live_counts(h).get(k, 0) >= n for k, n in baseline.items())


async def _all_mid_stream(streams: dict[int, Stream]) -> bool:
    return all(s.result.num_chunks >= MID_STREAM_CHUNKS or s.task.done()
               for s in streams.values())


async def _prefilling(control: ClusterControl, worker_id: str) -> bool:
    try:
        w = (await control.stats())["workers"].get(worker_id, {})
    except Exception:  # a stats call that failed: look again
        return False
    return int(w.get("num_prefilling", 0)) > 0


async def _pick_target(fault: Fault, control: ClusterControl) -> str:
    if fault is Fault.SCHEDULER:
        return control.scheduler_name
    if fault is Fault.ROUTER:
        replicas = await control.router_replicas()
        if not replicas:
            raise RuntimeError("no router replica found")
        return replicas[0]
    workers = (await control.stats())["workers"]
    role = "prefill" if fault is Fault.PREFILL else "decode"
    alive = [(w.get("num_held", 0) + w.get("num_prefilling", 0), wid)
             for wid, w in workers.items() if w["alive"] and w["role"] == role]
    if not alive:
        raise RuntimeError(f"no live {role} worker to drill")
    target = max(alive)[1]
    if fault is Fault.DECODE_HANG and not await control.is_local(target):
        raise RuntimeError(f"{target} runs on another machine: a hang drill signals its "
                           "process, so run it on that machine")
    return target


async def _inject(fault: Fault, control: ClusterControl, target: str) -> int | None:
    """Apply the fault; the pid of a stopped process (to resume if it outlives the drill)."""
    if fault is Fault.DECODE_HANG:
        pid = int((await control.worker_status(target))["pid"])
        os.kill(pid, signal.SIGSTOP)
        return pid
    if fault is Fault.ROUTER:
        await control.kill(target, restart=False, namespace="serve")  # Serve replaces it
        return None
    await control.kill(target, restart=True)
    return None


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # killed and restarted, as it should be


def _judge_probes(res: DrillResult, probes: list[Probe]) -> None:
    """Recovery: when the first probe that started after the last failed one answered
    (0 when no probe failed)."""
    res.num_probes = len(probes)
    res.num_probe_failures = sum(p.status != 200 for p in probes)
    res.retry_after_seen = any(p.retry_after for p in probes if p.status == 503)
    for p in probes:
        res.probe_statuses[str(p.status)] = res.probe_statuses.get(str(p.status), 0) + 1
    failed = [p.start_s for p in probes if p.status != 200]
    if not failed:
        res.recovery_s = 0.0
        return
    after = [p.end_s for p in probes if p.status == 200 and p.start_s > max(failed)]
    res.recovery_s = round(min(after), 3) if after else None


async def _wait_idle(http: Endpoint, baseline: dict[str, int]) -> tuple[float | None, int | None]:
    """When every worker reports no block in use and no request runs (twice in a row),
    and the blocks still in use at the end of the wait."""
    n_workers = sum(baseline.values())
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    quiet_since: float | None = None
    used: int | None = None
    while time.monotonic() < deadline:
        try:
            m = await http.metrics()
        except Exception:  # the router answering nothing yet
            m = {}
        if m and m.get("num_workers_reporting", 0) >= n_workers:
            used = int(m.get("tierserve:kv_cache_used_blocks", 0))
            busy = (m.get("tierserve:num_requests_running", 0)
                    + m.get("tierserve:num_requests_waiting", 0)
                    + m.get("tierserve:num_requests_preempted", 0))
            if used == 0 and busy == 0:
                if quiet_since is None:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since >= 1.0:
                    return quiet_since, 0
            else:
                quiet_since = None
        await asyncio.sleep(0.5)
    return None, used

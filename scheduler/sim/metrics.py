"""Per-run figures from a finished simulation: attainment, goodput, tails, shares.

Attainment is the fraction of a tier's requests (rejected ones included) that
met every target of their tier; goodput is such requests per second of trace
(DistServe's definition). Token shares come two ways:
``token_share`` counts the prompt and output tokens of every completed request
(the whole run, queues drained), ``token_share_loaded`` only those served while
requests were still arriving (prompt tokens at the first token, output tokens
at completion, up to the last arrival), which is where a tier can be squeezed.
A tier starves when either is below 80 % of min(its share, its demand). Invariant counts cover the
whole run.

``weighted_miss`` is the objective (:mod:`scheduler.objective`: each tier's weight times
its miss share, over the tiers that had requests, the run's tier weights); ``last_end_s``
the seconds from the first arrival to the last request's end; ``work_conservation_s`` the
kernel's seconds per tier that a waiting request fitted a decode worker and was not placed
within a planning interval.

Output tokens are what the client got (the trace's output length, capped by the run's
``max_tokens``); the request's ``max_new_tokens`` is only the budget the kernel saw.
A request is completed when it finished by EOS (stop) or by its budget (length).
"""

from __future__ import annotations

import numpy as np

from scheduler.invariants import (
    check_anti_thrash,
    check_starvation_history,
    check_transitions,
    count_by_invariant,
)
from scheduler.objective import tier_weights, weighted_miss
from scheduler.request import RequestState
from scheduler.sim.belady import belady_hits
from scheduler.sim.simulator import Simulator
from scheduler.sim.slo import is_feasible, met_slo

STARVATION_FLOOR = 0.8


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(sim: Simulator, load: float, with_belady: bool = True) -> dict[str, object]:
    tiers = sim.tiers
    n = tiers.num_tiers
    per: list[dict[str, list[float] | int]] = [  # per tier
        {"ttft": [], "tpot": [], "attained": 0, "total": 0, "completed": 0, "rejected": 0,
         "tokens": 0, "loaded": 0, "demand": 0, "feasible": 0, "feasible_attained": 0} for _ in range(n)
    ]
    out_tokens = 0
    last = 0.0
    window_end = max((j.req.arrival_time for j in sim.jobs.values()), default=0.0)
    done_states = (RequestState.FINISHED_STOPPED, RequestState.FINISHED_LENGTH)
    for job in sim.jobs.values():
        req = job.req
        out = job.num_output_tokens
        p = per[req.tier]
        p["total"] += 1  # type: ignore[operator]
        spec = tiers[req.tier]
        # Feasible: its prefill alone, on an idle worker with a cold cache, fits TTFT.
        feasible = is_feasible(req.prompt_len, spec, sim.cost.prefill_s)
        p["feasible"] += int(feasible)  # type: ignore[operator]
        p["demand"] += req.prompt_len + out  # type: ignore[operator]
        if req.state is RequestState.REJECTED:
            p["rejected"] += 1  # type: ignore[operator]
            continue
        if req.state not in done_states or req.first_token_time is None:
            continue
        ttft = req.first_token_time - req.arrival_time
        tpot = ((req.finish_time - req.first_token_time) / (out - 1)  # type: ignore[operator]
                if out > 1 else 0.0)
        p["ttft"].append(ttft)  # type: ignore[union-attr]
        p["tpot"].append(tpot)  # type: ignore[union-attr]
        p["completed"] += 1  # type: ignore[operator]
        p["tokens"] += req.prompt_len + out  # type: ignore[operator]
        if req.first_token_time <= window_end:
            p["loaded"] += req.prompt_len  # type: ignore[operator]
        if req.finish_time is not None and req.finish_time <= window_end:
            p["loaded"] += out  # type: ignore[operator]
        out_tokens += out
        last = max(last, req.finish_time or 0.0)
        ok = met_slo(req, out, spec)
        p["attained"] += int(ok)  # type: ignore[operator]
        p["feasible_attained"] += int(ok and feasible)  # type: ignore[operator]
    arrivals = [j.req.arrival_time for j in sim.jobs.values()]
    span = max(max(arrivals) - min(arrivals), 1e-9) if arrivals else 1.0
    tot_tokens = sum(p["tokens"] for p in per) or 1  # type: ignore[misc]
    tot_loaded = sum(p["loaded"] for p in per) or 1  # type: ignore[misc]
    tot_demand = sum(p["demand"] for p in per) or 1  # type: ignore[misc]
    shares = tiers.shares()
    tier_out: dict[str, dict[str, object]] = {}
    attained = 0
    for t, p in enumerate(per):
        attained += p["attained"]  # type: ignore[operator]
        share = p["tokens"] / tot_tokens  # type: ignore[operator]
        loaded = p["loaded"] / tot_loaded  # type: ignore[operator]
        entitled = min(shares[t], p["demand"] / tot_demand)  # type: ignore[operator]
        tier_out[str(t)] = {
            "attainment": p["attained"] / p["total"] if p["total"] else None,  # type: ignore[operator]
            "ttft_p50": _pct(p["ttft"], 50),  # type: ignore[arg-type]
            "ttft_p99": _pct(p["ttft"], 99),  # type: ignore[arg-type]
            "tpot_p99": _pct(p["tpot"], 99),  # type: ignore[arg-type]
            "completed": p["completed"],
            "rejected": p["rejected"],
            "requests": p["total"],
            # Requests whose cold prefill alone fits the TTFT target, and the
            # attainment among them (an SLO no scheduler can meet is excluded).
            "feasible": p["feasible"],
            "attainment_feasible": (p["feasible_attained"] / p["feasible"]  # type: ignore[operator]
                                    if p["feasible"] else None),
            "token_share": share,
            "token_share_loaded": loaded,
            "entitled_share": entitled,
            "starved": min(share, loaded) < STARVATION_FLOOR * entitled,
        }
    reqs = [j.req for j in sim.jobs.values()]
    # When the last request ended, from the first arrival: its finish (a rejection's
    # included), or the end of the simulation for one that never finished.
    last_end = (max(r.finish_time if r.finish_time is not None else sim.now for r in reqs)
                - min(arrivals) if reqs else None)
    records = [r for req in reqs for r in req.history]
    violations = list(sim.violations)
    violations += check_transitions(records)
    violations += check_starvation_history(reqs, tiers, sim.now)
    violations += check_anti_thrash(records, tiers.anti_thrash_s)
    hits = sum(w.index.num_hit_blocks for w in sim.prefill if w.index is not None)
    lookups = sum(w.index.num_lookup_blocks for w in sim.prefill if w.index is not None)
    run: dict[str, object] = {
        "policy": sim.policy_label,
        "load": load,
        "mode": sim.mode.value,
        "max_tokens": sim.max_tokens,
        "goodput_rps": attained / span,
        # The objective (scheduler.objective): the tiers' weights from the run's TierConfig;
        # attainment counts rejected and unfinished requests as misses.
        "weighted_miss": weighted_miss({t: d["attainment"] for t, d in tier_out.items()},
                                       tier_weights(tiers)),
        "last_end_s": last_end,
        # Per tier, the kernel's seconds past one planning interval that a waiting request
        # fitted a decode worker and was not placed (0 unless the policy claims it).
        "work_conservation_s": list(sim.cs.work_conservation_s(sim.now)),
        "throughput_tok_s": out_tokens / max(last, 1e-9),
        "preemptions": sim.num_preemptions,
        "prefix_hit_rate": hits / lookups if lookups else None,
        "wall_s": sim.wall_s,
        "sim_end_s": sim.now,
        "requests": len(reqs),
        "tiers": tier_out,
        "violations": count_by_invariant(violations),
    }
    if with_belady and lookups:
        bh = bl = 0
        for w in sim.prefill:
            if w.index is not None and w.accesses:
                h, n_ = belady_hits(w.accesses, w.index.capacity)
                bh += h
                bl += n_
        run["belady_hit_rate"] = bh / bl if bl else None
        run["prefix_vs_belady"] = (run["prefix_hit_rate"] / run["belady_hit_rate"]  # type: ignore[operator]
                                   if bh else None)
    return run

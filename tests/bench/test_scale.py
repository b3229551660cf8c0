"""bench-scale's figures from hand-made outcomes and samples (no cluster here; the
planner loop itself runs in tests/cluster)."""

from __future__ import annotations

import argparse

from bench import scale
from bench.scale import Outcome

TTFT = (1.0, 4.0)


def ok(tier: int, t: float, ttft: float = 0.2) -> Outcome:
    return Outcome(tier, t, ttft, t + 1.0, 200, None, 16)


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    scale.add_arguments(p)
    return p.parse_args(list(argv))


def test_recovery_is_the_first_arrival_after_which_tier0_holds() -> None:
    outs = [ok(0, 10 + i, ttft=3.0 if i < 5 else 0.2) for i in range(40)]  # 5 late, then fine
    assert scale.tier0_recovery_s(outs, TTFT, 10.0, 60.0) == 5.0
    assert scale.tier0_recovery_s([ok(0, 10 + i) for i in range(40)], TTFT, 10.0, 60.0) == 0.0
    late = [ok(0, 10 + i, ttft=3.0) for i in range(40)]
    assert scale.tier0_recovery_s(late, TTFT, 10.0, 60.0) is None
    # Tier 1 and arrivals outside the step do not count.
    assert scale.tier0_recovery_s([ok(1, 12, ttft=9.0)] + outs, TTFT, 10.0, 60.0) == 5.0


def test_scale_down_and_changes_from_the_samples() -> None:
    tl = [{"t": float(t), "decode": n, "prefill": 0}
          for t, n in [(0, 1), (10, 2), (20, 3), (100, 3), (130, 2), (150, 1), (160, 2),
                       (170, 1), (300, 1)]]
    assert scale.scale_down_s(tl, 100.0, 1) == 70.0  # at the minimum for good from 170
    assert scale.pool_changes(tl, "decode", 0.0, 100.0) == [(10.0, 2), (20.0, 3)]
    assert scale.scale_down_s(tl[:-3], 100.0, 1) == 50.0
    assert scale.scale_down_s(tl[:4], 100.0, 1) is None


def test_summary_counts_lost_requests_and_attainment() -> None:
    a = args("--before-s", "10", "--step-s", "20", "--after-s", "30")
    outs = [ok(0, 1.0), ok(1, 2.0), Outcome(1, 3.0, None, 4.0, 429),
            Outcome(0, 4.0, None, 5.0, 0, "ReadTimeout: x"), Outcome(1, 5.0, None, 6.0, 503),
            Outcome(1, 6.0, 0.1, 7.0, 200, "worker_failed")]
    tl = [{"t": 0.0, "decode": 1}, {"t": 50.0, "decode": 1}]
    r = scale.summarize(outs, tl, a, 0, TTFT)
    assert r["lost_requests"] == 3 and r["rejected_429"] == 1
    assert r["attainment_by_tier"] == {"0": 0.5, "1": 0.25}
    assert r["scale_down_s"] == 20.0 and r["changes_in_steady_state"] == 0
    assert r["leaked_blocks"] == 0


def test_bad_arguments_are_refused() -> None:
    assert scale.run(args("--base-rps", "0")) == 2
    assert scale.run(args("--min-decode", "3", "--max-decode", "2")) == 2

"""The Grafana dashboard queries only series that router/metrics.py exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from router.metrics import METRIC_NAMES, MetricsRecorder
from scheduler.request import Decision, DecisionRecord, RequestState

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "tierserve" / "dashboards" / "tierserve.json"
SERIES = re.compile(r"tierserve:[A-Za-z0-9_:]+")


def exposed_series() -> set[str]:
    """Every sample name a recorder exposes once each of its methods has been called."""
    rec = MetricsRecorder()
    rec.on_decision(DecisionRecord("a", RequestState.DECODING, RequestState.PREEMPTING,
                                   Decision.PREEMPT_SWAP, "kv_full", 1.0), 3)
    rec.on_admission_rejected(1, "queue_full")
    rec.on_request_finished(0, 0.1, 0.02, 1.0, True, num_output_tokens=3, queue_s=0.01)
    rec.on_request_finished(1, 5.0, None, 6.0, False)
    rec.on_transfer("same_domain", 10, 0.001)
    rec.on_prefix_lookup(4, 2)
    rec.set_queue_depth(0, 1)
    rec.set_request_counts(0, running=1, preempted=0, swapped=0)
    rec.set_kv_usage("decode-0", 1, 2)
    rec.set_shares([0.5, 0.5])
    names = set()
    for fam in text_string_to_metric_families(rec.render().decode()):
        names.update(s.name for s in fam.samples)
    return names


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_every_queried_series_is_exposed() -> None:
    exposed = exposed_series()
    queries = dashboard_queries()
    assert len(queries) >= 20
    used = {name for q in queries for name in SERIES.findall(q)}
    assert used, "the dashboard queries no tierserve series"
    assert used <= exposed, sorted(used - exposed)


def test_dashboard_covers_the_issue_panels() -> None:
    used = {name for q in dashboard_queries() for name in SERIES.findall(q)}
    base = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in used}
    for family in ("tierserve:time_to_first_token_seconds", "tierserve:time_per_output_token_seconds",
                   "tierserve:e2e_request_latency_seconds", "tierserve:slo_met",
                   "tierserve:kv_cache_usage_perc", "tierserve:num_preemptions",
                   "tierserve:kv_transfer_bytes", "tierserve:kv_transfer_seconds",
                   "tierserve:tier_share", "tierserve:num_requests_waiting"):
        assert family in base, family
    assert base <= METRIC_NAMES


def test_panels_do_not_overlap() -> None:
    dash = json.loads(DASHBOARD.read_text())
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])

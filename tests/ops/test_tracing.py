"""cluster/tracing.py: the trace of a forced preemption shows its causal chain."""

from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster.tracing import (
    JsonlSpanExporter,
    RequestTracer,
    TracingError,
    make_exporter,
    otlp_traces_url,
    root_span_id_for,
    trace_id_for,
)

EVENT_KEYS = {"req_id", "decision", "triggered_by", "mem_pressure", "slo_slack", "kv_reuse_hit",
              "blocking_req_id"}


def spans_of(exporter: InMemorySpanExporter, req_id: str) -> list:
    tid = trace_id_for(req_id)
    return sorted((s for s in exporter.get_finished_spans() if s.context.trace_id == tid),
                  key=lambda s: (s.start_time, s.name != "request"))


def test_victim_trace_shows_preemption_for_the_tier0_request(scenario) -> None:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(exporter)
    assert tracer.record(scenario.logs["Y"]) == format(trace_id_for("Y"), "032x")
    spans = spans_of(exporter, "Y")
    root = spans[0]
    assert root.name == "request" and root.parent is None
    assert root.attributes["tierserve.tier"] == 3
    assert root.attributes["tierserve.num_preemptions"] == 1
    phases = [s for s in spans if s.name != "request"]
    assert [s.name for s in phases] == ["queue", "prefill", "transfer", "decode", "preemption",
                                        "decode"]
    assert all(s.parent.span_id == root.context.span_id for s in phases)
    pre = phases[4]
    assert (pre.start_time, pre.end_time) == (1_300_000_000, 1_700_000_000)
    assert pre.attributes["tierserve.preempt.mode"] == "swap"
    assert pre.attributes["tierserve.preempt.blocking_req_id"] == "X"
    assert pre.attributes["tierserve.preempt.triggered_by"] == "tier0_arrival:decode-1"
    # The preemption links to the blocking request's root span, before X is even recorded.
    (link,) = pre.links
    assert (link.context.trace_id, link.context.span_id) == (trace_id_for("X"),
                                                             root_span_id_for("X"))
    assert [e.name for e in pre.events] == ["preempt_swap", "preempt_done"]
    ev = pre.events[0]
    assert EVENT_KEYS <= set(ev.attributes)
    assert ev.attributes["blocking_req_id"] == "X" and ev.attributes["mem_pressure"] == 1.0
    assert ev.timestamp == 1_300_000_000
    assert [e.name for e in phases[5].events] == ["resume_swap_in"]
    assert [e.name for e in root.events] == ["finish_stop"]


def test_blocked_request_trace_names_what_it_waited_for(scenario) -> None:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(exporter, time_offset_s=1000.0)
    tracer.record(scenario.logs["X"])
    tracer.record(scenario.logs["Y"])
    spans = spans_of(exporter, "X")
    queue = next(s for s in spans if s.name == "queue")
    assert queue.attributes["tierserve.blocking_req_id"] == "Y"
    assert queue.attributes["tierserve.queue.mem_pressure"] == 0.97
    assert queue.links[0].context.trace_id == trace_id_for("Y")
    assert (queue.start_time, queue.end_time) == (1_001_000_000_000, 1_001_420_000_000)
    transfer = next(s for s in spans if s.name == "transfer")
    assert transfer.attributes["tierserve.transfer.topology_class"] == "same_node"
    assert transfer.attributes["tierserve.transfer.bytes"] == 3 * 1024 * 1024
    prefill = next(s for s in spans if s.name == "prefill")
    assert prefill.attributes["tierserve.kv_reuse_hit"] == 2
    assert prefill.events[0].attributes["blocking_req_id"] == "Y"
    # Every DecisionRecord of both requests appears exactly once as an event.
    events = [e for s in exporter.get_finished_spans() for e in s.events]
    n_records = sum(len(log.records) for log in scenario.logs.values())
    assert len(events) == n_records


def test_jsonl_file_when_no_endpoint(tmp_path, scenario) -> None:
    path = tmp_path / "traces" / "spans.jsonl"
    tracer = RequestTracer.from_settings(jsonl_path=path)
    tracer.record(scenario.logs["Y"])
    tracer.shutdown()
    lines = path.read_text().splitlines()
    assert len(lines) == 7
    spans = [json.loads(line) for line in lines]
    pre = next(s for s in spans if s["name"] == "preemption")
    assert pre["attributes"]["tierserve.preempt.mode"] == "swap"
    assert pre["events"][0]["attributes"]["decision"] == "preempt_swap"
    assert {s["context"]["trace_id"] for s in spans} == {"0x" + format(trace_id_for("Y"), "032x")}


def test_exporter_choice_and_clear_errors(tmp_path) -> None:
    assert isinstance(make_exporter(jsonl_path=tmp_path / "t.jsonl"), JsonlSpanExporter)
    with pytest.raises(TracingError, match="OTLP endpoint or a JSONL"):
        make_exporter()
    with pytest.raises(TracingError, match="cannot open"):
        JsonlSpanExporter(tmp_path)  # a folder, not a file
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError:
        with pytest.raises(TracingError, match="opentelemetry-exporter-otlp-proto-http"):
            make_exporter("http://127.0.0.1:4318")
    else:
        assert type(make_exporter("http://127.0.0.1:4318")).__name__ == "OTLPSpanExporter"
    assert otlp_traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert otlp_traces_url("https://c/custom/path") == "https://c/custom/path"
    with pytest.raises(TracingError, match="http://"):
        otlp_traces_url("c:4318")


def test_otlp_http_export_reaches_a_collector(scenario) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                        reason="opentelemetry-exporter-otlp-proto-http is not installed")
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    received: list[tuple[str, ExportTraceServiceRequest]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            received.append((self.path, req))
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        tracer = RequestTracer.from_settings(
            otlp_endpoint=f"http://127.0.0.1:{server.server_address[1]}")
        tracer.record(scenario.logs["Y"])
        assert tracer.flush(10_000)
        tracer.shutdown()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert received and {path for path, _ in received} == {"/v1/traces"}
    spans = [s for _, req in received for rs in req.resource_spans for ss in rs.scope_spans
             for s in ss.spans]
    assert sorted(s.name for s in spans) == sorted(["request", "queue", "prefill", "transfer",
                                                    "decode", "preemption", "decode"])
    pre = next(s for s in spans if s.name == "preemption")
    attrs = {a.key: a.value.string_value for a in pre.attributes}
    assert attrs["tierserve.preempt.mode"] == "swap"
    assert attrs["tierserve.preempt.blocking_req_id"] == "X"
    assert pre.trace_id == trace_id_for("Y").to_bytes(16, "big")

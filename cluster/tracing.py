"""OpenTelemetry traces of requests: one trace per request, one span per phase.

Data flow: when a request ends, the global scheduler hands its
:class:`~cluster.why.RequestLog` (DecisionRecords, workers, transfers) to
:meth:`RequestTracer.record`. The tracer cuts the log into phases
(:func:`cluster.why.phases`) and emits, with the records' own timestamps::

    request  (root: tierserve.req_id, tierserve.tier, tierserve.state, workers)
    ├── queue        ┐ one span per phase, in order; PREEMPTING + PREEMPTED is one
    ├── prefill      │ "preemption" span (tierserve.preempt.mode, .blocking_req_id,
    ├── transfer     │ .triggered_by, and a link to the blocking request's trace); a
    ├── decode       │ queue span names (and links) the request it waited on; a transfer
    ├── preemption   │ span carries tierserve.transfer.topology_class / .bytes / .src /
    └── decode       ┘ .dst

A request's trace id is ``trace_id_for(req_id)`` (a hash of the id), so links between
requests hold whichever trace is recorded first, and a trace is found from its req_id.

Every DecisionRecord becomes a span event named after its decision on the phase span
it opened or happened in (a terminal decision lands on the root span), carrying
``req_id, decision, triggered_by, mem_pressure, slo_slack, kv_reuse_hit,
blocking_req_id`` (empty string when none) and ``from_state, to_state``.

Where spans go (:func:`make_exporter`): OTLP when an endpoint is configured (needs the
``opentelemetry-exporter-otlp-proto-http`` package, or ``-grpc`` for protocol "grpc";
without it a :class:`TracingError` says so), otherwise a JSONL file
(:class:`JsonlSpanExporter`, one span per line in OpenTelemetry's JSON shape). Tests
pass an ``InMemorySpanExporter``.

API::

    tracer = RequestTracer.from_settings(otlp_endpoint=None, jsonl_path="traces.jsonl")
    tracer = RequestTracer(InMemorySpanExporter())          # tests
    trace_id_hex = tracer.record(log, now=None)
    tracer.shutdown()                                         # flushes

``time_offset_s`` is added to record times to get Unix seconds (pass
``time.time() - time.monotonic()`` when records use the monotonic clock).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags

from cluster.why import PREEMPT_MODES, Phase, PhaseKind, RequestLog, phases
from scheduler.request import DecisionRecord

OtlpProtocol = Literal["http/protobuf", "grpc"]


def trace_id_for(req_id: str) -> int:
    """The trace id of ``req_id``'s trace: derived from the id, so a request's trace can
    be found (and linked to) from its id alone."""
    return int.from_bytes(hashlib.sha256(req_id.encode()).digest()[:16], "big") or 1


def root_span_id_for(req_id: str) -> int:
    return int.from_bytes(hashlib.sha256(b"root/" + req_id.encode()).digest()[:8], "big") or 1


def _root_context(req_id: str) -> SpanContext:
    return SpanContext(trace_id_for(req_id), root_span_id_for(req_id), is_remote=True,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED))


class _RequestIdGenerator(IdGenerator):
    """Random ids, except for the root span the tracer is about to start (under its lock)."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self.next_root: tuple[int, int] | None = None

    def generate_trace_id(self) -> int:
        return self.next_root[0] if self.next_root else self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        if self.next_root:
            span_id, self.next_root = self.next_root[1], None
            return span_id
        return self._random.generate_span_id()


class TracingError(RuntimeError):
    """Tracing cannot be set up as configured; the message says what to change."""


class JsonlSpanExporter(SpanExporter):
    """Appends each finished span as one JSON line (OpenTelemetry's ``to_json`` shape)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        except OSError as e:
            raise TracingError(f"trace file {self.path}: cannot open ({e.strerror})") from None
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(json.loads(s.to_json(indent=None)), separators=(",", ":"))
                 for s in spans]
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write("".join(line + "\n" for line in lines))
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
        return True


def make_exporter(
    otlp_endpoint: str | None = None,
    jsonl_path: str | Path | None = None,
    protocol: OtlpProtocol = "http/protobuf",
) -> SpanExporter:
    """OTLP to ``otlp_endpoint`` when given, else JSONL to ``jsonl_path``."""
    if otlp_endpoint:
        if protocol == "grpc":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcExporter,
                )
            except ImportError:
                raise TracingError(
                    f"OTLP/gRPC export to {otlp_endpoint} needs the package "
                    "opentelemetry-exporter-otlp-proto-grpc (pip install it), or leave the "
                    "endpoint empty to write traces to a JSONL file"
                ) from None
            return GrpcExporter(endpoint=otlp_endpoint)
        if protocol != "http/protobuf":
            raise TracingError(f"tracing protocol {protocol!r}: use 'http/protobuf' or 'grpc'")
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )
        except ImportError:
            raise TracingError(
                f"OTLP/HTTP export to {otlp_endpoint} needs the package "
                "opentelemetry-exporter-otlp-proto-http (pip install it), or leave the "
                "endpoint empty to write traces to a JSONL file"
            ) from None
        return HttpExporter(endpoint=otlp_traces_url(otlp_endpoint))
    if jsonl_path is None:
        raise TracingError("tracing needs an OTLP endpoint or a JSONL file path")
    return JsonlSpanExporter(jsonl_path)


def otlp_traces_url(endpoint: str) -> str:
    """``http://collector:4318`` -> ``http://collector:4318/v1/traces`` (a full path is kept)."""
    if not endpoint.startswith(("http://", "https://")):
        raise TracingError(f"OTLP/HTTP endpoint {endpoint!r}: must start with http:// or https://")
    scheme, _, rest = endpoint.partition("://")
    host, slash, path = rest.partition("/")
    return endpoint if slash and path else f"{scheme}://{host}/v1/traces"


def _ns(t: float, offset: float) -> int:
    return int(round((t + offset) * 1e9))


def _event_attributes(r: DecisionRecord) -> dict[str, str | float | int]:
    return {
        "req_id": r.req_id,
        "decision": r.decision.value,
        "triggered_by": r.triggered_by,
        "mem_pressure": r.mem_pressure,
        "slo_slack": r.slo_slack,
        "kv_reuse_hit": r.kv_reuse_hit,
        "blocking_req_id": r.blocking_req_id or "",
        "from_state": r.from_state.value,
        "to_state": r.to_state.value,
    }


def _phase_attributes(log: RequestLog, p: Phase,
                      closing: DecisionRecord | None) -> dict[str, str | float | int]:
    """A phase span's attributes; ``closing`` is the decision that ended the phase."""
    attrs: dict[str, str | float | int] = {"tierserve.phase": p.kind.value,
                                           "tierserve.req_id": log.req_id}
    first = p.opened_by
    if p.kind is PhaseKind.QUEUE and closing is not None:
        # What the request waited for shows on the decision that let it go.
        attrs["tierserve.queue.ended_by"] = closing.decision.value
        attrs["tierserve.queue.mem_pressure"] = closing.mem_pressure
        if closing.blocking_req_id:
            attrs["tierserve.blocking_req_id"] = closing.blocking_req_id
    if p.kind is PhaseKind.PREFILL and log.prefill_worker_id:
        attrs["tierserve.worker_id"] = log.prefill_worker_id
        attrs["tierserve.kv_reuse_hit"] = max((r.kv_reuse_hit for r in p.records), default=0)
    elif p.kind in (PhaseKind.DECODE, PhaseKind.PREEMPTION) and log.decode_worker_id:
        attrs["tierserve.worker_id"] = log.decode_worker_id
    if p.kind is PhaseKind.PREEMPTION and first is not None:
        attrs["tierserve.preempt.mode"] = PREEMPT_MODES.get(first.decision, first.decision.value)
        attrs["tierserve.preempt.triggered_by"] = first.triggered_by
        attrs["tierserve.preempt.blocking_req_id"] = first.blocking_req_id or ""
        attrs["tierserve.preempt.mem_pressure"] = first.mem_pressure
    if p.kind is PhaseKind.TRANSFER:
        for t in log.transfers:
            if p.start - 1e-9 <= t.start_time <= p.end + 1e-9:
                attrs["tierserve.transfer.topology_class"] = t.topology_class
                attrs["tierserve.transfer.bytes"] = t.num_bytes
                attrs["tierserve.transfer.seconds"] = t.seconds
                attrs["tierserve.transfer.src"] = t.src_worker_id
                attrs["tierserve.transfer.dst"] = t.dst_worker_id
                break
    return attrs


class RequestTracer:
    """Turns finished requests' logs into OpenTelemetry traces on a private provider.

    A request's trace id is :func:`trace_id_for` its req_id, so the preemption span of
    a victim links to its blocker's trace (and a queue span to the request it waited
    on) whichever of the two is recorded first.
    """

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        service_name: str = "tierserve",
        time_offset_s: float = 0.0,
        batch: bool = False,
    ) -> None:
        self.time_offset_s = time_offset_s
        self._ids = _RequestIdGenerator()
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                        id_generator=self._ids)
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("tierserve.requests")
        self._lock = threading.Lock()

    @classmethod
    def from_settings(
        cls,
        otlp_endpoint: str | None = None,
        jsonl_path: str | Path | None = None,
        *,
        protocol: OtlpProtocol = "http/protobuf",
        service_name: str = "tierserve",
        time_offset_s: float = 0.0,
    ) -> RequestTracer:
        exporter = make_exporter(otlp_endpoint, jsonl_path, protocol)
        # A network exporter must not hold up the caller; a file write is cheap.
        return cls(exporter, service_name=service_name, time_offset_s=time_offset_s,
                   batch=bool(otlp_endpoint))

    def record(self, log: RequestLog, now: float | None = None) -> str:
        """Emit ``log`` as one trace; returns the trace id (32 hex digits)."""
        with self._lock:
            return self._record(log, now)

    def _record(self, log: RequestLog, now: float | None) -> str:
        off = self.time_offset_s
        parts = phases(log, now)
        end = parts[-1].end if parts else log.arrival_time
        last_state = log.records[-1].to_state.value if log.records else "queued"
        self._ids.next_root = (trace_id_for(log.req_id), root_span_id_for(log.req_id))
        root = self._tracer.start_span(
            "request", kind=SpanKind.SERVER, start_time=_ns(log.arrival_time, off),
            attributes={
                "tierserve.req_id": log.req_id,
                "tierserve.tier": log.tier,
                "tierserve.state": last_state,
                "tierserve.prompt_len": log.prompt_len,
                "tierserve.num_output_tokens": log.num_output_tokens,
                "tierserve.prefill_worker_id": log.prefill_worker_id or "",
                "tierserve.decode_worker_id": log.decode_worker_id or "",
                "tierserve.num_preemptions": sum(
                    1 for r in log.records if r.decision in PREEMPT_MODES),
            },
        )
        self._ids.next_root = None
        ctx = trace.set_span_in_context(root)
        placed: set[int] = set()
        for i, p in enumerate(parts):
            closing = parts[i + 1].opened_by if i + 1 < len(parts) else None
            attrs = _phase_attributes(log, p, closing)
            blocker = attrs.get("tierserve.blocking_req_id") or attrs.get(
                "tierserve.preempt.blocking_req_id")
            links = ([Link(_root_context(str(blocker)),
                           {"tierserve.link": "blocked_by", "tierserve.req_id": str(blocker)})]
                     if blocker else [])
            span = self._tracer.start_span(p.kind.value, context=ctx,
                                           start_time=_ns(p.start, off), attributes=attrs,
                                           links=links)
            for r in p.records:
                placed.add(id(r))
                span.add_event(r.decision.value, _event_attributes(r), _ns(r.time, off))
            span.end(end_time=_ns(p.end, off))
        for r in log.records:
            if id(r) not in placed:
                root.add_event(r.decision.value, _event_attributes(r), _ns(r.time, off))
        root.end(end_time=_ns(max(end, log.arrival_time), off))
        return format(root.get_span_context().trace_id, "032x")

    def flush(self, timeout_millis: int = 30000) -> bool:
        return self._provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self._provider.shutdown()

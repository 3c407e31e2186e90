"""OpenTelemetry tracing for llm-lanes: one trace per request across Router -> PrefixCache -> lane replica.

Each deployment replica (its own process) builds one `Tracing` from the app's tracing settings in its __init__.
The Router continues the caller's trace (W3C `traceparent` from HTTP headers or gRPC metadata), opens the spans
it owns and passes its context on as a plain dict field of the request (`Tracing.inject()`); the PrefixCache and
lane replicas continue from that dict (`Tracing.extract()`), so handle calls need no Ray tracing support.

exporter "none" (the default) installs no provider at all: every helper returns at once, spans are the shared
INVALID_SPAN and carriers stay empty, so tracing off costs a branch per call.

Sampling is ParentBased(TraceIdRatioBased(sample_ratio)): the Router decides, downstream replicas follow the
sampled flag in the carrier, so a trace is never half recorded.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from app.config import TRACING_EXPORTERS, TracingConfig

# Span names (the list, plus the two roots that hold them together).
SPAN_REQUEST = "request"  # Router: the whole request, SERVER kind, child of the caller's traceparent
SPAN_CLASSIFY = "classify"
SPAN_ADMIT = "admit"
SPAN_QUEUE_WAIT = "queue_wait"  # Router: waiting in the class's admission queue
SPAN_ROUTE = "route"  # Router/request router: picking lane and replica
SPAN_PREFIX_LOOKUP = "prefix_lookup"  # PrefixCache: index lookup
SPAN_LANE_GENERATE = "lane_generate"  # lane replica: the engine call, parent of the three below
SPAN_ENGINE_QUEUE = "engine_queue"  # vLLM: arrival -> first scheduled
SPAN_PREFILL = "prefill"  # vLLM: first scheduled -> first token
SPAN_DECODE = "decode"  # vLLM: first token -> last token

EXPORTERS = TRACING_EXPORTERS
TRACE_CONTEXT_FIELD = "trace_context"  # suggested name of the carrier field in handle-call requests
INSTRUMENTATION_NAME = "llm_lanes"


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """The parts of a finished span that tests and the file exporter need, ids as W3C hex."""
    context = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": trace.format_trace_id(context.trace_id),
        "span_id": trace.format_span_id(context.span_id),
        "parent_span_id": trace.format_span_id(span.parent.span_id) if span.parent else None,
        "start_time_ns": span.start_time,
        "end_time_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "component": (span.resource.attributes.get("llm_lanes.component") if span.resource else None),
        "status": span.status.status_code.name,
    }


class JsonLinesFileSpanExporter(SpanExporter):
    """Appends one JSON line per span. Several replica processes may append to one file: each span is one write()
    of one line to a file opened O_APPEND, which Linux keeps whole for such small writes."""

    def __init__(self, path: str):
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_to_dict(span), default=str) + "\n" for span in spans)
        with self._lock:
            fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def read_span_file(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def carrier_from_grpc_metadata(metadata: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    """gRPC invocation metadata (e.g. RayServegRPCContext.invocation_metadata()) -> a carrier dict.
    gRPC keys are already lower case; binary (-bin) values are skipped, trace context is text."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            carrier[key.lower()] = value
    return carrier


def _make_exporter(settings: TracingConfig) -> SpanExporter:
    if settings.exporter == "console":
        return ConsoleSpanExporter()
    if settings.exporter == "otlp":
        # Imported here: only an otlp setup pays for the exporter (requests, protobuf encoders).
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=settings.otlp_endpoint)
    if settings.exporter == "file":
        return JsonLinesFileSpanExporter(settings.file_path or "")
    return InMemorySpanExporter()


class Tracing:
    """A replica's tracer, propagator and span helpers. Build it with setup_tracing()."""

    def __init__(self, provider: TracerProvider | None = None, memory_exporter: InMemorySpanExporter | None = None):
        self._provider = provider
        self._tracer = provider.get_tracer(INSTRUMENTATION_NAME) if provider is not None else None
        self._memory_exporter = memory_exporter
        self._propagator = TraceContextTextMapPropagator()

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    # --- context propagation -------------------------------------------------------------------------------------

    def inject(self, context: Context | None = None, carrier: dict[str, str] | None = None) -> dict[str, str]:
        """The current (or given) trace context as {"traceparent", ["tracestate"]}: put it in the request dict sent
        through a deployment handle. Empty when tracing is off."""
        carrier = {} if carrier is None else carrier
        if self._tracer is not None:
            self._propagator.inject(carrier, context=context)
        return carrier

    def extract(self, carrier: Mapping[str, str] | None) -> Context | None:
        """A context from incoming HTTP headers (Starlette's Headers look up case-insensitively), a handle-call
        carrier dict, or carrier_from_grpc_metadata(...). None when tracing is off or nothing usable came in
        (a span started with context=None then continues the current context or starts a new trace)."""
        if self._tracer is None or not carrier:
            return None
        return self._propagator.extract(carrier)

    @staticmethod
    def context_with(span: Span) -> Context:
        """A context whose parent is `span`, for spans started later or elsewhere (e.g. after an await)."""
        return trace.set_span_in_context(span)

    # --- spans ---------------------------------------------------------------------------------------------------

    @contextmanager
    def span(
        self,
        name: str,
        *,
        context: Context | None = None,
        attributes: Mapping[str, Any] | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> Iterator[Span]:
        """`with tracing.span(SPAN_CLASSIFY): ...` — a child of the current span (or of `context`), made current
        for the block so nested spans and inject() see it. Exceptions are recorded and re-raised."""
        if self._tracer is None:
            yield trace.INVALID_SPAN
            return
        with self._tracer.start_as_current_span(name, context=context, kind=kind, attributes=attributes) as span:
            yield span

    def start_span(
        self,
        name: str,
        *,
        context: Context | None = None,
        attributes: Mapping[str, Any] | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        start_time_ns: int | None = None,
    ) -> Span:
        """A span the caller ends itself (span.end()), for phases that do not fit one `with` block, e.g. a
        streaming answer. Not made current: pass Tracing.context_with(span) to its children."""
        if self._tracer is None:
            return trace.INVALID_SPAN
        return self._tracer.start_span(
            name, context=context, kind=kind, attributes=attributes, start_time=start_time_ns
        )

    def record_span(
        self,
        name: str,
        start_time_ns: int,
        end_time_ns: int,
        *,
        context: Context | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """A span whose times are known afterwards, e.g. engine_queue / prefill / decode from the engine's
        per-request timestamps (converted to epoch nanoseconds, time.time_ns() scale)."""
        if self._tracer is None:
            return
        span = self._tracer.start_span(name, context=context, attributes=attributes, start_time=start_time_ns)
        span.end(end_time=end_time_ns)

    def record_engine_phases(
        self,
        *,
        arrival_ns: int,
        scheduled_ns: int | None,
        first_token_ns: int | None,
        finished_ns: int,
        context: Context | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """engine_queue (arrival -> scheduled), prefill (scheduled -> first token), decode (first token -> end).
        A phase whose boundary is missing (aborted before it) is left out rather than invented."""
        if self._tracer is None:
            return
        if scheduled_ns is not None:
            self.record_span(SPAN_ENGINE_QUEUE, arrival_ns, scheduled_ns, context=context, attributes=attributes)
            if first_token_ns is not None:
                self.record_span(SPAN_PREFILL, scheduled_ns, first_token_ns, context=context, attributes=attributes)
        if first_token_ns is not None:
            self.record_span(SPAN_DECODE, first_token_ns, finished_ns, context=context, attributes=attributes)

    # --- tests and shutdown --------------------------------------------------------------------------------------

    def finished_spans(self) -> list[dict[str, Any]]:
        """Spans collected by the "memory" exporter (empty for other exporters)."""
        if self._memory_exporter is None:
            return []
        return [span_to_dict(span) for span in self._memory_exporter.get_finished_spans()]

    def force_flush(self, timeout_ms: int = 5000) -> bool:
        return self._provider.force_flush(timeout_ms) if self._provider is not None else True

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


def setup_tracing(
    settings: TracingConfig | Mapping[str, Any] | None = None,
    *,
    component: str = "",
    exporter: SpanExporter | None = None,
) -> Tracing:
    """Build a replica's Tracing from the config's observability.tracing (a TracingConfig, or its dump; None: the
    schema's defaults, no tracing). `component` names the deployment ("Router", "HotLane", ...) on every span.
    `exporter` overrides the one the settings name (tests). The provider is private to the returned object rather
    than OpenTelemetry's process-global one, which can be set only once per process."""
    if not isinstance(settings, TracingConfig):
        settings = TracingConfig.model_validate(dict(settings or {}))
    if settings.exporter == "none" and exporter is None:
        return Tracing()

    resource = Resource.create({"service.name": settings.service_name, "llm_lanes.component": component})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    span_exporter = exporter if exporter is not None else _make_exporter(settings)
    # Off the request path for a network exporter; synchronous (and so deterministic) for the local ones.
    if settings.exporter == "otlp" and exporter is None:
        provider.add_span_processor(BatchSpanProcessor(span_exporter))
    else:
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    memory = span_exporter if isinstance(span_exporter, InMemorySpanExporter) else None
    return Tracing(provider, memory_exporter=memory)

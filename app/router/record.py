"""One request's metrics and trace at the Router, from arrival to its single outcome. No Ray."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Mapping

from app.classes import RequestClass
from app.observability.metrics import LANE_NONE, tpot_seconds
from app.observability.percentile import percentile
from app.observability.tracing import SPAN_QUEUE_WAIT, SPAN_REQUEST, Tracing

# nginx's "client closed request": the outcome of a request whose client went away before it finished.
CLIENT_CLOSED_STATUS = 499
# request_class label of a request refused before it could be classified (e.g. an unknown X-Request-Class).
UNKNOWN_CLASS = "unknown"
# A shared do-nothing context manager: the span helpers' answer when tracing is off (nothing allocated).
_NO_SPAN = contextlib.nullcontext()


# Recent TTFTs kept per class and lane for the admin stats: enough for a p99, few enough to follow the load.
RECENT_TTFT_SAMPLES = 512


class RecentTtft:
    """This Router's last TTFTs (streamed requests, body in hand to first chunk) per class and lane, as p50 / p99 for
    `/v1/admin/stats`: what the Router itself measured, free of any client's own delays. The histogram metric
    (llm_lanes_ttft_seconds) is the long-run record; this is the recent window."""

    def __init__(self, size: int = RECENT_TTFT_SAMPLES):
        self.size = size
        self._samples: dict[tuple[str, str], deque[float]] = {}

    def add(self, request_class: str, lane: str, seconds: float) -> None:
        self._samples.setdefault((request_class, lane), deque(maxlen=self.size)).append(seconds)

    def summary(self) -> dict[str, dict[str, dict[str, float | int]]]:
        summary: dict[str, dict[str, dict[str, float | int]]] = {}
        for (request_class, lane), samples in sorted(self._samples.items()):
            values = list(samples)
            summary.setdefault(request_class, {})[lane] = {
                "p50_ms": round(percentile(values, 50) * 1000, 1), "p99_ms": round(percentile(values, 99) * 1000, 1),
                "count": len(values)}
        return summary


def outcome_for_status(status: int) -> str:
    """The llm_lanes_requests_total outcome of a request that ended with this HTTP status."""
    if status < 400:
        return "success"
    if status == 429:
        return "rejected"
    if status in (408, 504):
        return "timeout"
    if status == CLIENT_CLOSED_STATUS:
        return "cancelled"
    return "error"


def reason_label(reason: str) -> str:
    """A bounded metric label from a decision reason: "queue_full (12 >= 24)" -> "queue_full"."""
    return reason.split(" (", 1)[0]


class RequestRecord:
    """One request's metrics and trace at the Router, from arrival to its single outcome.

    Metrics: router decision time, TTFT / queue wait at the first chunk (streamed requests only: a non-streamed
    answer arrives whole, so its first chunk is its last), E2E, TPOT and output tokens at the end, and exactly one
    requests_total sample whatever path the request ends on (success, error, 429, deadline, client gone). Once the
    pipeline has named its `model` (the label it was served under), the per-model metrics too: TTFT, one
    model_requests_total sample, and its prompt tokens (where the lane answered) and output tokens.
    Tracing: the `request` SERVER span (continuing the caller's traceparent) and its children; with tracing off no
    span exists and span_for() hands back a shared no-op context.
    """

    def __init__(self, metrics, tracing: Tracing, carrier: Mapping[str, str] | None, kind: str,
                 clock=time.monotonic, recent_ttft: RecentTtft | None = None):
        self.metrics = metrics
        self.recent_ttft = recent_ttft
        self.tracing = tracing
        self.clock = clock
        # arrived_at: the request reached Serve's HTTP proxy (its stamp: app/router/arrival_stamp.py) or else the
        # Router, what admission's waits count from; received_at: its body is in hand too (the proxy hands the body
        # over when asked: on a busy proxy that takes a while), where the Router's own TTFT and E2E start.
        self.arrived_at = self.received_at = clock()
        self.request_class: RequestClass | str | None = None  # a str only for UNKNOWN_CLASS
        self.lane: str = LANE_NONE
        self.ttft_s: float | None = None
        # The per-model metrics' label and prompt size, set when the request's prompt is prepared (None: a refusal
        # before that, which the per-model metrics leave out).
        self.model: str | None = None
        self.prompt_tokens = 0
        # The lane sent a first chunk: its engine took the prompt in.
        self.answered = False
        self.finished = False
        self._admitted_at: float | None = None
        self._queue_span = None
        self.span = None
        self.context = None
        if tracing.enabled:
            from opentelemetry.trace import SpanKind

            self.span = tracing.start_span(SPAN_REQUEST, context=tracing.extract(carrier), kind=SpanKind.SERVER,
                                           attributes={"llm_lanes.kind": kind})
            self.context = Tracing.context_with(self.span)

    def span_for(self, name: str):
        """A child span of `request` for a synchronous block (classify, admit, route)."""
        return self.tracing.span(name, context=self.context) if self.span is not None else _NO_SPAN

    def carrier(self) -> dict[str, str]:
        """The trace context for the lane (LaneRequest.trace_carrier): its lane_generate span joins this trace."""
        return self.tracing.inject(self.context) if self.span is not None else {}

    def waited_at_proxy(self, seconds: float) -> None:
        """The request reached Serve's HTTP proxy `seconds` before the Router saw it."""
        self.arrived_at -= seconds
        if self.span is not None:
            self.span.set_attribute("llm_lanes.proxy_wait_s", seconds)

    def received(self) -> None:
        """The request's body is in hand (HTTP: read from Serve's proxy)."""
        self.received_at = self.clock()
        self.metrics.observe_request_receive(self.received_at - self.arrived_at)

    def admitted(self, request_class: RequestClass) -> None:
        self.request_class = request_class
        self._admitted_at = self.clock()
        if self.span is not None:
            self._queue_span = self.tracing.start_span(SPAN_QUEUE_WAIT, context=self.context)

    def decided(self) -> None:
        """Classified, admitted and routed: everything the Router does before the lane call."""
        self.metrics.observe_router_decision(self.clock() - self.received_at, request_class=self.request_class)

    def first_chunk(self, streamed: bool) -> None:
        now = self.clock()
        self.answered = True
        self._end_queue_wait()
        if not streamed:
            return
        self.ttft_s = now - self.received_at
        self.metrics.observe_ttft(self.ttft_s, lane=self.lane, request_class=self.request_class)
        if self.model is not None:
            self.metrics.observe_model_ttft(self.ttft_s, model=self.model)
        if self.recent_ttft is not None:
            self.recent_ttft.add(str(getattr(self.request_class, "value", self.request_class)), self.lane, self.ttft_s)
        if self._admitted_at is not None:
            self.metrics.observe_queue_wait(now - self._admitted_at, request_class=self.request_class)

    def succeeded(self, output_tokens: int) -> None:
        if self.finished:
            return
        e2e = self.clock() - self.received_at
        self.metrics.observe_e2e(e2e, lane=self.lane, request_class=self.request_class)
        tpot = tpot_seconds(e2e, self.ttft_s, output_tokens) if self.ttft_s is not None else None
        if tpot is not None:
            self.metrics.observe_tpot(tpot, lane=self.lane, request_class=self.request_class)
        self._finish(200, output_tokens)

    def failed(self, status: int, output_tokens: int = 0) -> None:
        self._finish(status, output_tokens)

    def _finish(self, status: int, output_tokens: int) -> None:
        if self.finished:
            return
        self.finished = True
        self._end_queue_wait()
        request_class = self.request_class or UNKNOWN_CLASS
        self.metrics.count_output_tokens(output_tokens, lane=self.lane, request_class=request_class)
        self.metrics.count_request(lane=self.lane, request_class=request_class, outcome=outcome_for_status(status),
                                   status=status)
        if self.model is not None:
            self._count_for_model(status, output_tokens)
        if self.span is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_attributes({"llm_lanes.lane": self.lane,
                                      "llm_lanes.request_class": str(getattr(request_class, "value", request_class)),
                                      "llm_lanes.outcome": outcome_for_status(status),
                                      "http.response.status_code": status,
                                      "llm_lanes.output_tokens": output_tokens})
            if status >= 500:
                self.span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            self.span.end()

    def _count_for_model(self, status: int, output_tokens: int) -> None:
        self.metrics.count_model_request(model=self.model, outcome=outcome_for_status(status))
        if self.answered:
            self.metrics.count_model_tokens(self.prompt_tokens, model=self.model, kind="prompt")
        self.metrics.count_model_tokens(output_tokens, model=self.model, kind="output")

    def _end_queue_wait(self) -> None:
        if self._queue_span is not None:
            self._queue_span.end()
            self._queue_span = None



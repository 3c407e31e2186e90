"""Router: the ingress deployment. OpenAI-compatible HTTP routes under FastAPI (`@serve.ingress`).

Per request: tokenize once with the model's own tokenizer (chat template applied here), classify, pick the lane,
stream the lane's answer back. Decisions live in plain modules (classes.py, openai_api.py); this is glue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time
import weakref
from dataclasses import replace
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.batch import openai_shapes as batch_shapes
from app.batch.store import BatchStoreError, ClaimedLine, ConflictError, NotFoundError
from app.config import load_app_config
from app.lanes.replica_stats import merge_replica_stats
from app.lanes.types import LaneChunk, LaneRequest, LaneSaturated, SamplingOptions
from app.observability.metrics import LANE_NONE, tpot_seconds
from app.observability.tracing import (
    SPAN_ADMIT,
    SPAN_CLASSIFY,
    SPAN_QUEUE_WAIT,
    SPAN_REQUEST,
    SPAN_ROUTE,
    Tracing,
    carrier_from_grpc_metadata,
)
from app.prefix_cache.decision_stats import add_decision_observer, all_decision_stats
from app.prefix_cache.index import block_hashes
from app.prefix_cache.mirror import mirror_stats
from app.proto import convert
from app.proto.llm_lanes.v1 import llm_lanes_pb2 as pb
from app.router import openai_api as api
from app.classes import REQUEST_CLASS_HEADER, Lane, RequestClass, UnknownRequestClass, classify, policy_for
from app.router.control import REASON_KV_HEADROOM, Outcome, TrafficControl
from app.router.replica_counts import LANE_DEPLOYMENTS, health_response, running_replicas
from app.router.slot_waiters import SlotWaiters
from app.router.handoff import REASON_DECODE_ON_COLD, continuation_lane, handoff_after_tokens
from app.router.spill import COLD_LANE_INTERACTIVE_PRIORITY, RouteDecision, RouteRefusal

logger = logging.getLogger(__name__)
LANE_OF_DEPLOYMENT = {deployment: lane for lane, deployment in LANE_DEPLOYMENTS.items()}

fastapi_app = FastAPI(title="llm-lanes", docs_url="/docs", openapi_url="/openapi.json")


@fastapi_app.exception_handler(api.OpenAIError)
async def _openai_error(_: Request, error: api.OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


@fastapi_app.exception_handler(BatchStoreError)
async def _batch_store_error(_: Request, error: BatchStoreError) -> JSONResponse:
    status = 404 if isinstance(error, NotFoundError) else 409 if isinstance(error, ConflictError) else 400
    converted = api.OpenAIError(status, str(error), code={404: "not_found", 409: "conflict"}.get(status))
    return JSONResponse(converted.body(), status_code=status)


@fastapi_app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    converted = api.validation_error(list(error.errors()))
    return JSONResponse(converted.body(), status_code=converted.status)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    converted = api.OpenAIError(error.status_code, str(error.detail), code="not_found" if error.status_code == 404
                                else None)
    return JSONResponse(converted.body(), status_code=error.status_code)


@fastapi_app.exception_handler(Exception)
async def _unexpected_error(_: Request, error: Exception) -> JSONResponse:
    # Never a stack trace to the client; the log has it.
    logger.exception("unhandled error")
    return JSONResponse(api.OpenAIError(500, "internal server error", type="server_error").body(), status_code=500)


class CreateBatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


# A client may ask for a shorter deadline than its class's (never a longer one), in seconds.
REQUEST_TIMEOUT_HEADER = "x-request-timeout"


def _client_timeout(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise api.OpenAIError(400, f"X-Request-Timeout header {value!r} is not a positive number of seconds",
                              param="X-Request-Timeout", code="invalid_timeout")
    return seconds


# 503 codes that mean "the lane is down for now", not "this request is bad".
LANE_DOWN_CODES = {"lane_unavailable", "lanes_saturated", "cold_breaker_open", "hot_breaker_open"}
BATCH_LANE_DOWN_RETRY_S = 1.0
BATCH_LANE_DOWN_MAX_WAIT_S = 600.0


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# nginx's "client closed request": the outcome of a request whose client went away before it finished.
CLIENT_CLOSED_STATUS = 499
# request_class label of a request refused before it could be classified (e.g. an unknown X-Request-Class).
UNKNOWN_CLASS = "unknown"
# How often each Router replica publishes the batch backlog and its admission queue depths.
BACKLOG_METRICS_INTERVAL_S = 5.0
# Prompts above this many characters are validated and tokenized on a worker thread, not on the event loop: on the
# H200 a burst of 512 batch prompts of 2,048 tokens held every later request for ~3 s while the Router tokenized them
# inline (docs/benchmarks-gpu.md). Shorter prompts stay inline, where the thread hop would cost more than it saves.
TOKENIZE_INLINE_MAX_CHARS = 2048
# grpc.health.v1 Watch: how often the serving status is re-checked for a change.
HEALTH_WATCH_INTERVAL_S = 1.0
# grpc.health.v1 service names the Router answers for ("" is the server as a whole).
HEALTH_SERVICES = ("", "llm_lanes.v1.LlmLanes")
# A shared do-nothing context manager: the span helpers' answer when tracing is off (nothing allocated).
_NO_SPAN = contextlib.nullcontext()


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
    requests_total sample whatever path the request ends on (success, error, 429, deadline, client gone).
    Tracing: the `request` SERVER span (continuing the caller's traceparent) and its children; with tracing off no
    span exists and span_for() hands back a shared no-op context.
    """

    def __init__(self, metrics, tracing: Tracing, carrier: Mapping[str, str] | None, kind: str,
                 clock=time.monotonic):
        self.metrics = metrics
        self.tracing = tracing
        self.clock = clock
        self.arrived_at = clock()
        self.request_class: RequestClass | str | None = None
        self.lane: str = LANE_NONE
        self.ttft_s: float | None = None
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

    def admitted(self, request_class: RequestClass) -> None:
        self.request_class = request_class
        self._admitted_at = self.clock()
        if self.span is not None:
            self._queue_span = self.tracing.start_span(SPAN_QUEUE_WAIT, context=self.context)

    def decided(self) -> None:
        """Classified, admitted and routed: everything the Router does before the lane call."""
        self.metrics.observe_router_decision(self.clock() - self.arrived_at, request_class=self.request_class)

    def first_chunk(self, streamed: bool) -> None:
        now = self.clock()
        self._end_queue_wait()
        if not streamed:
            return
        self.ttft_s = now - self.arrived_at
        self.metrics.observe_ttft(self.ttft_s, lane=self.lane, request_class=self.request_class)
        if self._admitted_at is not None:
            self.metrics.observe_queue_wait(now - self._admitted_at, request_class=self.request_class)

    def succeeded(self, output_tokens: int) -> None:
        if self.finished:
            return
        e2e = self.clock() - self.arrived_at
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

    def _end_queue_wait(self) -> None:
        if self._queue_span is not None:
            self._queue_span.end()
            self._queue_span = None


class Generation:
    """One request on its lane: start (first chunk), then chunks under the class deadline, then bookkeeping once.

    Cancellation anywhere (client gone, deadline) cancels the lane call, which aborts the engine request.
    """

    def __init__(self, router: "Router", lane_request: LaneRequest, request_class: RequestClass, route: RouteDecision,
                 timeout_s: float, record: RequestRecord | None = None):
        self.router = router
        self.request_class = request_class
        self.route = route
        self.reasons = list(route.reasons)
        self.lane = route.lane
        self.lane_request = replace(lane_request, priority=route.priority,
                                    sampling=replace(lane_request.sampling, max_tokens=route.max_tokens),
                                    may_spill=router.control.may_spill(request_class, route.lane))
        self.timeout_s = timeout_s
        self.started_at = time.monotonic()
        self.deadline = self.started_at + timeout_s
        self.stream = None
        self.last: LaneChunk | None = None
        self._first: LaneChunk | None = None
        self._done = False
        self.record = record if record is not None else RequestRecord(router.metrics, router.tracing, None, "internal")
        self.record.request_class = request_class
        self.record.lane = self.lane.value
        # Decode handoff (app/router/handoff.py): the hot lane generates the first `handoff_after` tokens, then the
        # answer continues on the cold lane. The hot part's last chunk reaches the client as a middle chunk.
        self.requested_max_tokens = route.max_tokens
        self.prompt_tokens = len(lane_request.prompt_token_ids)
        self.handoff_after = handoff_after_tokens(
            request_class=request_class, lane=self.lane, prompt_tokens=self.prompt_tokens,
            max_tokens=route.max_tokens, stop=lane_request.sampling.stop,
            handoff_tokens=router.cfg.admission.interactive_decode_handoff_tokens,
            lane_caps=router.control.lane_caps)
        self._handed_off_ids: list[int] = []  # the hot part's tokens, the continuation's prompt suffix
        self._handoff_due = False
        self._continued = False
        if self.handoff_after is not None:
            self.reasons.append(REASON_DECODE_ON_COLD)
            self.lane_request = replace(self.lane_request, return_token_ids=True,
                                        sampling=replace(self.lane_request.sampling, max_tokens=self.handoff_after))
        for reason in self.reasons:
            router.metrics.count_degrade(reason=reason_label(reason), request_class=request_class)
        # A batch request counts against its lane's batch slots (and, on the hot lane, the loans) until it ends,
        # however it ends: the finalizer is idempotent (end_batch_slot() runs it at most once) and also frees a slot
        # that the code paths missed.
        self.end_batch_slot = lambda: None
        if request_class is RequestClass.BATCH:
            router.control.batch_started(self.lane)
            self.end_batch_slot = weakref.finalize(self, router.control.batch_ended, self.lane)

    def headers(self) -> dict[str, str]:
        headers = {"x-llm-lanes-lane": self.lane.value, "x-llm-lanes-request-class": self.request_class.value}
        first = self._first or self.last
        if first is not None and first.replica_id:
            # Which engine replica serves it: lets operators (and the prefix-affinity tests) see routing.
            headers["x-llm-lanes-replica"] = first.replica_id
        if self.reasons:
            headers["x-llm-lanes-degraded"] = ",".join(self.reasons)
        return headers

    def _remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def start(self) -> None:
        try:
            await self._start_on_lane()
        except BaseException:
            self.end_batch_slot()
            raise

    async def _start_on_lane(self) -> None:
        control = self.router.control
        if not control.allow(self.lane):
            raise api.OpenAIError(503, f"the {self.lane.value} lane is failing; retry shortly", type="server_error",
                                  code=f"{self.lane.value}_breaker_open", headers={"Retry-After": "1"})
        try:
            self._first = await self._open_stream()
        except LaneSaturated:
            # The hot replica keeps its KV headroom for realtime: this interactive request goes to the cold lane.
            control.hot_refused_for_kv()
            control.finished(self.request_class, self.lane, Outcome(ok=True), None)
            self.lane = Lane.COLD
            self.record.lane = self.lane.value
            self.reasons.append(REASON_KV_HEADROOM)
            self.router.metrics.count_degrade(reason=REASON_KV_HEADROOM, request_class=self.request_class)
            if self.handoff_after is not None:
                # On the cold lane from its first token: nothing left to hand off.
                self.handoff_after = None
                self.reasons.remove(REASON_DECODE_ON_COLD)
            self.lane_request = replace(self.lane_request, may_spill=False, return_token_ids=False,
                                        sampling=replace(self.lane_request.sampling,
                                                         max_tokens=self.requested_max_tokens))
            if not control.allow(self.lane):
                raise api.OpenAIError(503, "both lanes are saturated or failing; retry shortly", type="server_error",
                                      code="lanes_saturated", headers={"Retry-After": "1"}) from None
            self._first = await self._open_stream()
        self.last = self._first
        self.record.first_chunk(streamed=self.lane_request.stream)

    async def _open_stream(self) -> LaneChunk:
        try:
            # Inside the try: the handle itself can refuse (no replica yet, back-pressure) before any chunk.
            self.stream = self.router.lanes[self.lane.value].options(stream=True).generate.remote(self.lane_request)
            return self._client_view(await asyncio.wait_for(self.stream.__anext__(), timeout=self._remaining()))
        except LaneSaturated:
            self.stream.cancel()
            raise
        except BaseException as error:
            self._fail(error)
            raise self._as_openai_error(error) from None

    async def chunks(self) -> AsyncIterator[LaneChunk]:
        try:
            if self._first is not None:
                yield self._first
            while self.last.finish_reason is None:
                try:
                    if self._handoff_due:
                        self._continue_elsewhere()
                    chunk = self._client_view(await asyncio.wait_for(anext(self.stream), timeout=self._remaining()))
                except StopAsyncIteration:
                    break
                except BaseException as error:
                    self._fail(error)
                    converted = self._as_openai_error(error)
                    self.record.failed(converted.status if isinstance(converted, api.OpenAIError)
                                       else CLIENT_CLOSED_STATUS, self._output_tokens())
                    raise converted from None
                self.last = chunk
                yield chunk
            self._finish(ok=True)
            self.record.succeeded(self._output_tokens())
        finally:
            # Done, failed or abandoned by the client: cancelling the lane call aborts the engine request.
            self.stream.cancel()
            self.end_batch_slot()
            if not self._done:
                # Abandoned mid-stream by the client: not the lane's fault, and no E2E sample for the deadline P99.
                self._done = True
                self.router.control.finished(self.request_class, self.lane, Outcome(ok=True), None)
            if not self.record.finished:
                self.record.failed(CLIENT_CLOSED_STATUS, self._output_tokens())

    def _client_view(self, chunk: LaneChunk) -> LaneChunk:
        """A chunk from the lane, as the client sees it: the continuation's counts go on from the hot part's, and
        the hot part's last chunk is not final when the cold lane is to go on."""
        if self._continued:
            return replace(chunk, completion_tokens=chunk.completion_tokens + len(self._handed_off_ids),
                           prompt_tokens=self.prompt_tokens,
                           cached_prompt_tokens=self._first.cached_prompt_tokens)
        if self.handoff_after is None:
            return chunk
        self._handed_off_ids.extend(chunk.token_ids)
        if chunk.finish_reason == "length" and chunk.completion_tokens == self.handoff_after:
            # The hot lane stopped at the handoff point, not at the client's limit (EOS or max_tokens): go on.
            self._handoff_due = True
            return replace(chunk, finish_reason=None, token_ids=())
        return replace(chunk, token_ids=())

    def _continue_elsewhere(self) -> None:
        """Send the rest of the answer to the cold lane (or the hot lane while the cold lane's breaker is open)."""
        control = self.router.control
        self._handoff_due = False
        # The hot part succeeded; the request's end-to-end sample is taken once, when the continuation ends.
        control.finished(self.request_class, self.lane, Outcome(ok=True), None)
        self.stream.cancel()
        self.lane = continuation_lane(control.allow(Lane.COLD))
        done = len(self._handed_off_ids)
        priority = COLD_LANE_INTERACTIVE_PRIORITY if self.lane is Lane.COLD else self.lane_request.priority
        self.lane_request = replace(
            self.lane_request, request_id=f"{self.lane_request.request_id}-decode", priority=priority,
            prompt_token_ids=[*self.lane_request.prompt_token_ids, *self._handed_off_ids],
            sampling=replace(self.lane_request.sampling, max_tokens=self.requested_max_tokens - done),
            may_spill=False, return_token_ids=False)
        self._continued = True
        self.stream = self.router.lanes[self.lane.value].options(stream=True).generate.remote(self.lane_request)

    def _output_tokens(self) -> int:
        return self.last.completion_tokens if self.last is not None else 0

    def _finish(self, ok: bool) -> None:
        self.end_batch_slot()
        if self._done:
            return
        self._done = True
        e2e = time.monotonic() - self.started_at if ok else None
        self.router.control.finished(self.request_class, self.lane, Outcome(ok=ok), e2e)

    def _fail(self, error: BaseException) -> None:
        if self.stream is not None:
            self.stream.cancel()
        if isinstance(error, asyncio.CancelledError):
            return  # the client went away: not the lane's fault
        logger.warning("request %s on the %s lane failed: %r", self.lane_request.request_id, self.lane.value, error)
        self._finish(ok=False)

    def _as_openai_error(self, error: BaseException) -> BaseException:
        if isinstance(error, asyncio.CancelledError):
            return error
        if isinstance(error, asyncio.TimeoutError):
            return api.OpenAIError(504, f"the request exceeded its {self.timeout_s:.0f} s deadline for the "
                                        f"{self.request_class.value} class and was aborted", type="timeout_error",
                                   code="deadline_exceeded")
        return api.OpenAIError(503, f"the {self.lane.value} lane could not serve the request; retry shortly",
                               type="server_error", code="lane_unavailable", headers={"Retry-After": "1"})


@serve.deployment(name="Router")
@serve.ingress(fastapi_app)
class Router:
    async def __init__(self, app_args: dict[str, Any], hot_lane, cold_lane, prefix_cache):
        from transformers import AutoTokenizer

        from app.batch.dispatcher import BatchDispatcher
        from app.batch.store import open_batch_store
        from app.batch.window import ConcurrencyWindow
        from app.observability.metrics import LlmLanesMetrics
        from app.observability.tracing import setup_tracing

        self.cfg = load_app_config(app_args)
        # Built here, not at import: Serve's metrics pick up the replica's tags when they are created.
        self.metrics = LlmLanesMetrics()
        self.tracing = setup_tracing(self.cfg.observability.tracing.model_dump(), component="Router")
        self.lanes = {"hot": hot_lane, "cold": cold_lane} if cold_lane is not None else {"hot": hot_lane}
        # Running replicas per lane, read from Serve's status every few seconds; None until the first read.
        self.lane_replicas: dict[str, int | None] = {lane: None for lane in self.lanes}
        self.control = TrafficControl(self.cfg)
        self.prefix_cache = prefix_cache
        # The lanes' request routers run in this process (they route this Router's handle calls): their decision
        # times become the llm_lanes_replica_routing_seconds histogram.
        add_decision_observer(self._observe_replica_routing)
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.tokenizer_source)
        # One thread: long prompts are tokenized one at a time, never concurrently on the shared tokenizer.
        self._tokenize_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        batch = self.cfg.batch
        self.batch_store = await asyncio.to_thread(open_batch_store, batch.store)
        # Every Router replica drains the durable queue; the store's leases keep two from running the same line.
        self.dispatcher = BatchDispatcher(
            self.batch_store, self._execute_batch_line,
            window=ConcurrencyWindow(min_size=batch.window_min, max_size=batch.window_max,
                                     target_latency_per_token_s=batch.target_latency_per_token_s,
                                     interval_s=batch.window_interval_s, slow_start=batch.window_slow_start),
            lease_s=batch.lease_s, poll_interval_s=batch.poll_interval_s, max_attempts=batch.max_attempts,
            hot_loans=self.cfg.admission.hot_batch_borrow_max,
        )
        self._wire_batch_slots()
        self._dispatcher_task = asyncio.create_task(self.dispatcher.run())
        self._backlog_metrics_task = asyncio.create_task(self._publish_backlog_metrics_forever())

    def _observe_replica_routing(self, deployment: str, decision, elapsed_s: float) -> None:
        lane = LANE_OF_DEPLOYMENT.get(deployment, deployment)
        self.metrics.observe_replica_routing(elapsed_s, lane=lane, reason=decision.reason.value)

    def _wire_batch_slots(self) -> None:
        """Batch slots per lane, counted in TrafficControl: the cold share is the dispatcher's (so batch goes to the
        hot lane only once it is taken), and flex requests waiting for a slot are woken as batch requests end."""
        self.control.cold_batch_slots = lambda: self.dispatcher.cold_capacity
        self.batch_waiters = SlotWaiters()
        self.control.on_batch_slot_freed = self.batch_waiters.notify_one

    async def _publish_backlog_metrics_forever(self) -> None:
        """Batch backlog (read from the shared store) and this replica's admission queue depths, as gauges; and the
        replica counts the dispatcher's share of the batch window follows."""
        while True:
            try:
                backlog = await asyncio.to_thread(self.batch_store.backlog_stats)
                self.metrics.set_batch_backlog(backlog.pending_lines)
                self._publish_queue_depths()
            except Exception as error:  # metrics must never take the Router down
                logger.warning("could not publish the batch backlog metric: %s", error)
            await self._refresh_replica_counts()
            await asyncio.sleep(BACKLOG_METRICS_INTERVAL_S)

    async def _refresh_replica_counts(self) -> None:
        """Running replicas per lane (GET /health) and for the batch dispatcher, whose window is per cold replica
        and split across Router replicas, from Serve's status. On failure the last counts stay (unknown, and 1
        and 1 for the dispatcher, at start), so neither health nor batch work flaps on a failed read."""
        try:
            app_name = serve.get_replica_context().app_name
            status = await asyncio.to_thread(serve.status)
        except Exception as error:
            logger.warning("could not read replica counts from serve.status(): %s", error)
            return
        for lane in self.lanes:
            count = running_replicas(status, app_name, LANE_DEPLOYMENTS[lane])
            if count is not None:
                self.lane_replicas[lane] = count
        if "cold" in self.lanes:
            routers = running_replicas(status, app_name, "Router")
            cold = self.lane_replicas["cold"]
            self.dispatcher.set_replica_counts(cold if cold is not None else self.dispatcher.cold_replicas,
                                               routers if routers else self.dispatcher.router_replicas)

    def _publish_queue_depths(self) -> None:
        for request_class, depth in self.control.queue_depths().items():
            self.metrics.set_queue_depth(depth, request_class=request_class)

    def _publish_queue_depth(self, request_class: RequestClass) -> None:
        """The one class a request entered or left (per request: one gauge write, not one per class)."""
        self.metrics.set_queue_depth(self.control.back_pressure.queued(request_class), request_class=request_class)

    def _new_record(self, carrier: Mapping[str, str] | None, kind: str) -> RequestRecord:
        return RequestRecord(self.metrics, self.tracing, carrier, kind)

    # ---- routes -------------------------------------------------------------------------------------------

    @fastapi_app.get("/health")
    async def health(self) -> JSONResponse:
        """For a load balancer: 503 while the hot lane has no running replica (replica_counts.health_response)."""
        status_code, body = health_response(self.lane_replicas)
        return JSONResponse(body, status_code=status_code)

    @fastapi_app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.cfg.model.served_name, "object": "model", "created": 0, "owned_by": "llm-lanes",
                      "max_model_len": self.cfg.model.max_model_len}],
        }

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, body: api.ChatCompletionRequest, request: Request):
        return await self._serve(body, request, kind="chat")

    @fastapi_app.post("/v1/completions")
    async def completions(self, body: api.CompletionRequest, request: Request):
        return await self._serve(body, request, kind="completion")

    def _chat_token_ids(self, body: api.ChatCompletionRequest) -> list[int]:
        if not body.messages:
            raise api.OpenAIError(400, "messages must hold at least one message", param="messages",
                                  code="empty_prompt")
        try:
            conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as error:
            raise api.OpenAIError(400, str(error), param="messages") from None
        if not any(m["content"].strip() for m in conversation):
            raise api.OpenAIError(400, "every message is empty: send some content", param="messages",
                                  code="empty_prompt")
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _completion_token_ids(self, body: api.CompletionRequest) -> list[int]:
        return self._prompt_token_ids(body.prompt)

    def _prompt_token_ids(self, prompt: str | list) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise api.OpenAIError(400, "send one prompt per request (a list of several is not supported)",
                                      param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise api.OpenAIError(400, "prompt is empty", param="prompt", code="empty_prompt")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            token_ids = list(prompt)
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in token_ids):
                raise api.OpenAIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not token_ids:
            raise api.OpenAIError(400, "prompt is empty", param="prompt", code="empty_prompt")
        return token_ids

    @fastapi_app.get("/v1/admin/stats")
    async def admin_stats(self) -> dict[str, Any]:
        async def ask(handle, method: str):
            try:
                return await asyncio.wait_for(getattr(handle, method).remote(), timeout=5)
            except Exception as error:
                return {"error": str(error)}

        names = list(self.lanes)
        *live, prefix, registry = await asyncio.gather(
            *(ask(self.lanes[n], "stats") for n in names), ask(self.prefix_cache, "stats"),
            ask(self.prefix_cache, "replica_stats"))
        return {
            "lanes": {name: merge_replica_stats(answer, registry.get(name, []) if "error" not in registry else [])
                      for name, answer in zip(names, live)},
            "prefix_cache": prefix,
            "router": {"breakers": self.control.breaker_states(), "queued_by_class": self.control.queue_depths(),
                       # The window is per cold replica; this Router keeps its share of window x cold replicas.
                       "batch_window": self.dispatcher.window.size,
                       "batch_in_flight_limit": self.dispatcher.capacity,
                       "batch_in_flight": self.dispatcher.in_flight,
                       # Batch requests (flex and Batch API lines) of this Router on each lane; those on the hot
                       # lane are loans (admission.hot_batch_borrow_max); flex requests waiting for a slot
                       # (batch.flex_waits_for_window).
                       "batch_on_lane": {lane.value: n for lane, n in self.control.batch_in_flight.items()},
                       "batch_on_lane_peak": {lane.value: n for lane, n in self.control.batch_in_flight_peak.items()},
                       "hot_batch_loans": self.control.hot_batch_loans,
                       "flex_waiting_for_slot": len(self.batch_waiters),
                       "replicas_seen": {"cold": self.dispatcher.cold_replicas,
                                         "router": self.dispatcher.router_replicas},
                       # This Router replica's choices of lane replica (prefix-affinity router), per deployment.
                       "replica_routing": all_decision_stats(),
                       # Its copy of the prefix index (prefix_cache.lookup: local_mirror): size, age, syncs.
                       "prefix_index_mirror": mirror_stats()},
        }

    @fastapi_app.post("/v1/admin/prefix_lookup")
    async def admin_prefix_lookup(self, request: Request) -> dict[str, Any]:
        """Which replicas hold how much of this prompt's prefix: {"prompt": str | [token ids]} -> matches."""
        try:
            body = await request.json()
        except ValueError:
            raise api.OpenAIError(400, "body is not JSON", code="invalid_json") from None
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), (str, list)):
            raise api.OpenAIError(400, "send {\"prompt\": <text or token ids>}", param="prompt")
        token_ids = self._prompt_token_ids(body["prompt"])
        block_size = self.cfg.hot_lane.engine.block_size
        matches = await self.prefix_cache.lookup.remote(block_hashes(token_ids, block_size), block_size)
        return {"prompt_tokens": len(token_ids), "block_size": block_size,
                "matches": [{"replica_id": replica, "matched_tokens": tokens} for replica, tokens in matches]}

    # ---- the request path ---------------------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.cfg.model.served_name:
            raise api.OpenAIError(404, f"model {model!r} does not exist: this server serves "
                                       f"{self.cfg.model.served_name!r}", param="model", code="model_not_found")

    def _prepare(self, body, kind: str, class_header: str | None) -> tuple[LaneRequest, RequestClass]:
        """Validate, tokenize once, classify: everything before admission. Raises OpenAIError."""
        self._check_model(body.model)
        token_ids = self._chat_token_ids(body) if kind == "chat" else self._completion_token_ids(body)
        try:
            request_class = classify(body.service_tier, class_header)
        except UnknownRequestClass as error:
            raise api.OpenAIError(400, str(error), param=error.param, code="invalid_request_class") from None
        limit = self.cfg.model.max_model_len
        if len(token_ids) >= limit:
            raise api.OpenAIError(400, f"this model's maximum context length is {limit} tokens and the prompt has "
                                       f"{len(token_ids)}: shorten the prompt", param="messages" if kind == "chat"
                                  else "prompt", code="context_length_exceeded")
        requested = body.requested_max_tokens
        max_tokens = requested if requested is not None else min(self.cfg.router.default_max_tokens,
                                                                 limit - len(token_ids))
        lane_request = LaneRequest(
            request_id=api.new_id("chatcmpl" if kind == "chat" else "cmpl"),
            prompt_token_ids=token_ids,
            sampling=SamplingOptions(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                     stop=body.stop_list, seed=body.seed, ignore_eos=body.ignore_eos),
            request_class=request_class.value,
            priority=policy_for(request_class).priority,
            stream=body.stream,
        )
        return lane_request, request_class

    async def _begin(self, lane_request: LaneRequest, request_class: RequestClass,
                     record: RequestRecord | None = None, from_batch_api: bool = False) -> "Generation":
        """Admit, route, send to a lane and wait for the first chunk. Raises OpenAIError with the right status.

        Failures raised from here are counted by the caller (`_start`) with the lane the record holds."""
        record = record if record is not None else self._new_record(None, "internal")
        record.request_class = request_class
        with record.span_for(SPAN_ADMIT) as span:
            admitted = self.control.admit(request_class)
            if record.span is not None:
                span.set_attributes({"llm_lanes.decision": admitted.decision.value,
                                     "llm_lanes.reason": admitted.reason})
        self.metrics.count_admission(decision="admit" if admitted.admitted else "reject",
                                     reason=reason_label(admitted.reason), request_class=request_class)
        if not admitted.admitted:
            raise api.OpenAIError(429, f"too many {request_class.value} requests are waiting ({admitted.reason}); "
                                       f"retry in {admitted.retry_after_s} s", type="rate_limit_error",
                                  code="queue_full", headers={"Retry-After": str(admitted.retry_after_s)})
        record.admitted(request_class)
        self._publish_queue_depth(request_class)
        started = False
        try:
            if request_class is RequestClass.BATCH and self.cfg.batch.flex_waits_for_window and not from_batch_api:
                # A flex request waits here for a batch slot, as the Batch API's lines wait in the store (the
                # dispatcher claims no more than its slots): no await between this and the slot being counted.
                await self.batch_waiters.wait_until(self.control.batch_slot_free)
            with record.span_for(SPAN_ROUTE):
                route = self.control.route(request_class, len(lane_request.prompt_token_ids),
                                           lane_request.sampling.max_tokens)
                if isinstance(route, RouteRefusal):
                    headers = {"Retry-After": str(route.retry_after_s)} if route.retry_after_s else None
                    raise api.OpenAIError(route.status, route.message, code=route.code,
                                          param="max_tokens" if route.status == 400 else None,
                                          type="invalid_request_error" if route.status == 400 else "server_error",
                                          headers=headers)
                timeout_s = self.control.timeout_s(request_class)
                if lane_request.client_timeout_s is not None:
                    timeout_s = min(timeout_s, lane_request.client_timeout_s)
                generation = Generation(self, lane_request, request_class, route, timeout_s, record=record)
            record.decided()
            await generation.start()
            started = True
            self.control.started(request_class)
            return generation
        finally:
            if not started:
                self.control.abandoned_before_start(request_class)
            self._publish_queue_depth(request_class)

    async def _start(self, body, kind: str, class_header: str | None, record: RequestRecord,
                     client_timeout_s: float | None = None,
                     from_batch_api: bool = False) -> tuple[LaneRequest, "Generation"]:
        """_prepare + _begin for every entry point (HTTP, gRPC, batch lines): the request's outcome is counted here
        when it ends before its first chunk, and the trace context travels to the lane in the LaneRequest."""
        try:
            with record.span_for(SPAN_CLASSIFY):
                if body.prompt_size() > TOKENIZE_INLINE_MAX_CHARS:
                    lane_request, request_class = await asyncio.get_running_loop().run_in_executor(
                        self._tokenize_executor, self._prepare, body, kind, class_header)
                else:
                    lane_request, request_class = self._prepare(body, kind, class_header)
            if client_timeout_s is not None:
                lane_request = replace(lane_request, client_timeout_s=client_timeout_s)
            if record.span is not None:
                lane_request = replace(lane_request, trace_carrier=record.carrier())
            return lane_request, await self._begin(lane_request, request_class, record, from_batch_api)
        except api.OpenAIError as error:
            self._count_refusal(record, body, class_header, error.status)
            raise
        except asyncio.CancelledError:
            self._count_refusal(record, body, class_header, CLIENT_CLOSED_STATUS)
            raise
        except Exception:
            self._count_refusal(record, body, class_header, 500)
            raise

    def _count_refusal(self, record: RequestRecord, body, class_header: str | None, status: int) -> None:
        if record.request_class is None:
            # Refused before classification (unknown model, empty prompt...): label it with the class it asked for.
            try:
                record.request_class = classify(getattr(body, "service_tier", None), class_header)
            except UnknownRequestClass:
                record.request_class = UNKNOWN_CLASS
        record.failed(status)

    async def _serve(self, body, request: Request, kind: str):
        record = self._new_record(request.headers if self.tracing.enabled else None, kind)
        lane_request, generation = await self._start(body, kind, request.headers.get(REQUEST_CLASS_HEADER), record,
                                                     _client_timeout(request.headers.get(REQUEST_TIMEOUT_HEADER)))
        headers = generation.headers()
        model, request_id = self.cfg.model.served_name, lane_request.request_id
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._sse_events(kind, request_id, model, generation, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(await self._collect(kind, request_id, model, generation), headers=headers)

    # ---- batch API (OpenAI Files + Batches) ---------------------------------------------------------------

    @fastapi_app.post("/v1/files")
    async def upload_file(self, file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:
        if purpose != "batch":
            raise api.OpenAIError(400, f"purpose {purpose!r} is not supported: use 'batch'", param="purpose")
        limit = self.cfg.batch.max_file_bytes
        content = await file.read(limit + 1)
        if len(content) > limit:
            raise api.OpenAIError(413, f"file is larger than the {limit}-byte limit: split it into several batches",
                                  param="file", code="file_too_large")
        record = await asyncio.to_thread(self.batch_store.create_file, purpose, file.filename or "batch.jsonl",
                                         content)
        return batch_shapes.file_object(record)

    @fastapi_app.get("/v1/files/{file_id}")
    async def get_file(self, file_id: str) -> dict[str, Any]:
        return batch_shapes.file_object(await asyncio.to_thread(self.batch_store.get_file, file_id))

    @fastapi_app.get("/v1/files/{file_id}/content")
    async def get_file_content(self, file_id: str) -> Response:
        content = await asyncio.to_thread(self.batch_store.file_content, file_id)
        return Response(content, media_type="application/jsonl")

    @fastapi_app.post("/v1/batches")
    async def create_batch(self, body: CreateBatchRequest) -> dict[str, Any]:
        record = await asyncio.to_thread(self.batch_store.create_batch, body.input_file_id, body.endpoint,
                                         body.completion_window, body.metadata)
        self.dispatcher.notify_new_work()
        return batch_shapes.batch_object(record)

    @fastapi_app.get("/v1/batches/{batch_id}")
    async def get_batch(self, batch_id: str) -> dict[str, Any]:
        return batch_shapes.batch_object(await asyncio.to_thread(self.batch_store.get_batch, batch_id))

    @fastapi_app.get("/v1/batches")
    async def list_batches(self, after: str | None = None, limit: int = Query(20, ge=1, le=100)) -> dict[str, Any]:
        page = await asyncio.to_thread(self.batch_store.list_batches, after, limit)
        return batch_shapes.list_object([batch_shapes.batch_object(b) for b in page.data], page.has_more)

    @fastapi_app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        record = await asyncio.to_thread(self.batch_store.cancel_batch, batch_id)
        return batch_shapes.batch_object(record)

    # ---- gRPC: llm_lanes.v1.LlmLanes and grpc.health.v1.Health through Serve's gRPC proxy ------------------------
    # Serve calls the method named like the RPC, with the request proto and (by this parameter name) `grpc_context`.
    # Each proto request becomes the OpenAI body an HTTP client would send and takes the HTTP path from there
    # (same validation, classes, admission, limits); an error sets the status on grpc_context. Unary RPCs then
    # return an empty reply (Serve sends the status, details and trailing metadata); streaming RPCs raise after
    # setting it (Serve keeps the code and details, trailing metadata is lost on that path).

    async def Generate(self, request: pb.CompletionRequest, grpc_context=None) -> AsyncIterator[pb.CompletionChunk]:
        # aclosing: a client that leaves closes the whole chain at once (lane call cancelled, outcome counted).
        async with contextlib.aclosing(self._grpc_stream("completion", request, grpc_context)) as messages:
            async for message in messages:
                yield message

    async def Complete(self, request: pb.CompletionRequest, grpc_context=None) -> pb.CompletionResponse:
        return await self._grpc_unary("completion", request, grpc_context)

    async def ChatComplete(self, request: pb.ChatCompletionRequest, grpc_context=None) -> pb.ChatCompletionResponse:
        return await self._grpc_unary("chat", request, grpc_context)

    async def ChatCompleteStream(self, request: pb.ChatCompletionRequest,
                                 grpc_context=None) -> AsyncIterator[pb.ChatCompletionChunk]:
        async with contextlib.aclosing(self._grpc_stream("chat", request, grpc_context)) as messages:
            async for message in messages:
                yield message

    async def GetStats(self, request: pb.GetStatsRequest, grpc_context=None) -> pb.GetStatsResponse:
        # Through JSON first: the Struct takes only str keys and JSON values.
        return convert.stats_response_from_dict(json.loads(json.dumps(await self.admin_stats(), default=str)))

    async def SubmitBatch(self, request: pb.SubmitBatchRequest, grpc_context=None) -> pb.Batch:
        """POST /v1/files + POST /v1/batches in one call."""
        try:
            try:
                submission = convert.submit_batch_from_proto(request)
            except convert.InvalidProtoRequest as error:
                raise api.OpenAIError(400, str(error), param=error.param) from None
            limit = self.cfg.batch.max_file_bytes
            if len(submission.input_content) > limit:
                raise api.OpenAIError(413, f"input_content is larger than the {limit}-byte limit: split it into "
                                           "several batches", param="input_content", code="file_too_large")
            file = await asyncio.to_thread(self.batch_store.create_file, "batch", "grpc-batch.jsonl",
                                           submission.input_content)
            record = await asyncio.to_thread(self.batch_store.create_batch, file.id, submission.endpoint,
                                             submission.completion_window, submission.metadata or None)
            self.dispatcher.notify_new_work()
            return convert.batch_from_openai(batch_shapes.batch_object(record))
        except (api.OpenAIError, BatchStoreError) as error:
            self._grpc_error(grpc_context, error)
            return pb.Batch()

    async def GetBatch(self, request: pb.GetBatchRequest, grpc_context=None) -> pb.GetBatchResponse:
        try:
            batch = batch_shapes.batch_object(await asyncio.to_thread(self.batch_store.get_batch, request.batch_id))
            output = error_lines = b""
            if request.include_output:
                if batch.get("output_file_id"):
                    output = await asyncio.to_thread(self.batch_store.file_content, batch["output_file_id"])
                if batch.get("error_file_id"):
                    error_lines = await asyncio.to_thread(self.batch_store.file_content, batch["error_file_id"])
            return convert.get_batch_response(batch, output, error_lines)
        except (api.OpenAIError, BatchStoreError) as error:
            self._grpc_error(grpc_context, error)
            return pb.GetBatchResponse()

    def _health_status(self, service: str) -> int:
        from grpc_health.v1 import health_pb2

        if service not in HEALTH_SERVICES:
            return health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        # Serving while no lane's circuit breaker is open (every lane can take requests).
        can_route = all(state != "open" for state in self.control.breaker_states().values())
        return health_pb2.HealthCheckResponse.SERVING if can_route else health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1.Health/Check (grpc_health_probe, Kubernetes gRPC probes)."""
        from grpc_health.v1 import health_pb2

        status = self._health_status(request.service)
        if status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
            if grpc_context is not None:
                grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
                grpc_context.set_details(f"unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request, grpc_context=None):
        """grpc.health.v1.Health/List: every service this server reports on."""
        from grpc_health.v1 import health_pb2

        return health_pb2.HealthListResponse(statuses={
            service: health_pb2.HealthCheckResponse(status=self._health_status(service)) for service in HEALTH_SERVICES
        })

    async def Watch(self, request, grpc_context=None):
        """grpc.health.v1.Health/Watch: the status now, then each change, until the client goes away."""
        from grpc_health.v1 import health_pb2

        last = None
        while True:
            status = self._health_status(request.service)
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            await asyncio.sleep(HEALTH_WATCH_INTERVAL_S)

    def _grpc_body(self, kind: str, request, stream: bool) -> tuple[Any, str | None]:
        """A proto request -> (the validated OpenAI body model, the class its enum asks for). Raises OpenAIError.
        An empty `model` means the served model (proto3 cannot tell unset from empty)."""
        to_openai = convert.chat_request_to_openai if kind == "chat" else convert.completion_request_to_openai
        try:
            converted = to_openai(request, stream=stream)
        except convert.InvalidProtoRequest as error:
            raise api.OpenAIError(400, str(error), param=error.param) from None
        body_model = api.ChatCompletionRequest if kind == "chat" else api.CompletionRequest
        try:
            body = body_model.model_validate({"model": self.cfg.model.served_name, **converted.body})
        except ValidationError as error:
            raise api.validation_error(error.errors()) from None
        return body, converted.request_class

    def _grpc_record(self, grpc_context, kind: str) -> RequestRecord:
        carrier = None
        if self.tracing.enabled and grpc_context is not None:
            carrier = carrier_from_grpc_metadata(grpc_context.invocation_metadata())
        return self._new_record(carrier, kind)

    @staticmethod
    def _grpc_error(grpc_context, error: api.OpenAIError | BatchStoreError) -> convert.GrpcError:
        """Put an OpenAI error (or a batch store error, mapped as the HTTP handler maps it) on the gRPC context."""
        if isinstance(error, BatchStoreError):
            status = 404 if isinstance(error, NotFoundError) else 409 if isinstance(error, ConflictError) else 400
            error = api.OpenAIError(status, str(error), code={404: "not_found", 409: "conflict"}.get(status))
        retry_after = error.headers.get("Retry-After")
        grpc_error = convert.grpc_error_from_openai(error.status, error.body(),
                                                    float(retry_after) if retry_after else None)
        if grpc_context is not None:
            convert.apply_grpc_error(grpc_context, grpc_error)
        return grpc_error

    @staticmethod
    def _serving(generation: "Generation") -> pb.ServingInfo:
        return convert.serving_info(generation.lane.value, generation.request_class.value, generation.reasons)

    async def _grpc_unary(self, kind: str, request, grpc_context):
        model = self.cfg.model.served_name
        try:
            body, request_class = self._grpc_body(kind, request, stream=False)
            lane_request, generation = await self._start(body, kind, request_class,
                                                         self._grpc_record(grpc_context, kind))
            response = await self._collect(kind, lane_request.request_id, model, generation)
        except api.OpenAIError as error:
            self._grpc_error(grpc_context, error)
            return pb.ChatCompletionResponse() if kind == "chat" else pb.CompletionResponse()
        build = convert.chat_response_from_openai if kind == "chat" else convert.completion_response_from_openai
        return build(response, self._serving(generation))

    async def _grpc_stream(self, kind: str, request, grpc_context):
        """Generate / ChatCompleteStream: the SSE path's chunks as proto messages. The first message carries
        `serving` (and the assistant role for chat), the one with finish_reason carries `usage`."""
        model = self.cfg.model.served_name
        try:
            body, request_class = self._grpc_body(kind, request, stream=True)
            lane_request, generation = await self._start(body, kind, request_class,
                                                         self._grpc_record(grpc_context, kind))
        except api.OpenAIError as error:
            raise RuntimeError(self._grpc_error(grpc_context, error).details) from None
        request_id, serving, sent_tokens, usage_sent = lane_request.request_id, self._serving(generation), 0, False
        try:
            async with contextlib.aclosing(generation.chunks()) as chunks:
                async for chunk in chunks:
                    usage = None
                    if chunk.finish_reason is not None:
                        usage = api.usage(chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_prompt_tokens)
                        usage_sent = True
                    num_tokens, sent_tokens = chunk.completion_tokens - sent_tokens, chunk.completion_tokens
                    if kind == "chat":
                        delta = {"content": chunk.text}
                        if serving is not None:
                            delta["role"] = "assistant"
                        yield convert.chat_chunk_from_openai(
                            api.chat_chunk(request_id, model, delta, chunk.finish_reason, usage), serving, num_tokens)
                    else:
                        yield convert.completion_chunk_from_openai(
                            api.completion_chunk(request_id, model, chunk.text, chunk.finish_reason, usage), serving,
                            num_tokens)
                    serving = None
        except api.OpenAIError as error:
            raise RuntimeError(self._grpc_error(grpc_context, error).details) from None
        if not usage_sent and generation.last is not None:
            # The lane ended without a finish reason: usage still travels, in a chunk of its own.
            last = generation.last
            usage = api.usage(last.prompt_tokens, last.completion_tokens, last.cached_prompt_tokens)
            build = api.chat_chunk if kind == "chat" else api.completion_chunk
            message = build(request_id, model, {} if kind == "chat" else "", None, usage, with_choice=False)
            to_proto = convert.chat_chunk_from_openai if kind == "chat" else convert.completion_chunk_from_openai
            yield to_proto(message, serving, 0)

    async def _execute_batch_line(self, line: ClaimedLine) -> dict[str, Any]:
        """One batch line through the same validation and lane path as an HTTP request, at batch class.

        Batch work is never refused for load: while its lane is unavailable (breaker open, replica restarting)
        the line waits here, its lease renewed by the dispatcher, instead of spending its attempts in seconds.
        """
        waited_s = 0.0
        while True:
            result = await self._execute_batch_line_once(line)
            error = result["body"].get("error") if isinstance(result["body"], dict) else None
            lane_down = result["status_code"] == 503 and error and error.get("code") in LANE_DOWN_CODES
            if not lane_down or waited_s >= BATCH_LANE_DOWN_MAX_WAIT_S:
                return result
            await asyncio.sleep(BATCH_LANE_DOWN_RETRY_S)
            waited_s += BATCH_LANE_DOWN_RETRY_S

    async def _execute_batch_line_once(self, line: ClaimedLine) -> dict[str, Any]:
        kind = "chat" if line.url == "/v1/chat/completions" else "completion"
        model = api.ChatCompletionRequest if kind == "chat" else api.CompletionRequest
        try:
            body = model.model_validate({**line.body, "stream": False, "service_tier": "flex"})
            lane_request, generation = await self._start(body, kind, None, self._new_record(None, kind),
                                                         from_batch_api=True)
            response = await self._collect(kind, lane_request.request_id, self.cfg.model.served_name, generation)
            return {"status_code": 200, "body": response, "request_id": lane_request.request_id}
        except ValidationError as error:
            converted = api.validation_error(error.errors())
            return {"status_code": converted.status, "body": converted.body()}
        except api.OpenAIError as error:
            return {"status_code": error.status, "body": error.body()}

    async def __del__(self):
        # Graceful shutdown: let in-flight lines finish recording; anything left is re-leased after lease_s.
        self.dispatcher.stop()
        self._backlog_metrics_task.cancel()
        self.tracing.shutdown()
        try:
            await asyncio.wait_for(self._dispatcher_task, timeout=10)
        except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
            pass
        self._tokenize_executor.shutdown(wait=False, cancel_futures=True)

    async def _collect(self, kind: str, request_id: str, model: str, generation: "Generation") -> dict[str, Any]:
        pieces = []
        async for chunk in generation.chunks():
            pieces.append(chunk.text)
        last = generation.last
        usage = api.usage(last.prompt_tokens, last.completion_tokens, last.cached_prompt_tokens)
        build = api.chat_response if kind == "chat" else api.completion_response
        return build(request_id, model, "".join(pieces), last.finish_reason, usage)

    async def _sse_events(self, kind: str, request_id: str, model: str, generation: "Generation",
                          include_usage: bool) -> AsyncIterator[str]:
        try:
            if kind == "chat":
                yield _sse(api.chat_chunk(request_id, model, {"role": "assistant", "content": ""}))
            async for chunk in generation.chunks():
                if kind == "chat":
                    delta = {"content": chunk.text} if chunk.text else {}
                    yield _sse(api.chat_chunk(request_id, model, delta, chunk.finish_reason))
                else:
                    yield _sse(api.completion_chunk(request_id, model, chunk.text, chunk.finish_reason))
            if include_usage:
                last = generation.last
                usage = api.usage(last.prompt_tokens, last.completion_tokens, last.cached_prompt_tokens)
                build = api.chat_chunk if kind == "chat" else api.completion_chunk
                empty = {} if kind == "chat" else ""
                yield _sse(build(request_id, model, empty, None, usage, with_choice=False))
            yield _sse("[DONE]")
        except api.OpenAIError as error:
            # Headers are gone once streaming started: the error travels as an SSE event, then the stream ends.
            yield _sse(error.body())

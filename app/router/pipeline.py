"""The Router's one request path: prepare -> admit -> route -> start -> stream or collect. A plain class, no Ray.

`RequestPipeline` is built from the tokenizer, the traffic control (admission, breakers, slots, the routing
decision), the lane clients, metrics and tracing; the Serve deployment only wires it, and every surface (HTTP, gRPC,
batch lines) calls `start()` and then reads the answer from the `LaneCall` it returns. Each request carries one
`RequestContext`: its class and lane as enums, the route decision with its reasons, and its record.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Mapping
from typing import Any

from app.classes import RequestClass, UnknownRequestClass, classify, policy_for
from app.config import AppConfig
from app.lanes.types import LaneRequest, SamplingOptions
from app.observability.tracing import SPAN_ADMIT, SPAN_CLASSIFY, SPAN_ROUTE, Tracing
from app.router import openai_api as api
from app.router.control import TrafficControl
from app.router.endpoints import Endpoint
from app.router.auth import OPEN_PRINCIPAL, Principal, check_class
from app.router.lane_call import LaneCall, LaneClients, RequestContext
from app.router.prompts import PromptTokenizer
from app.router.rate_limits import NO_CHARGE, Charge, RateLimited, RateLimiter
from app.router.record import CLIENT_CLOSED_STATUS, UNKNOWN_CLASS, RecentTtft, RequestRecord, reason_label
from app.router.spill import RouteDecision, RouteRefusal

logger = logging.getLogger(__name__)

# Prompts above this many characters are validated and tokenized on a worker thread, not on the event loop: on the
# H200 a burst of 512 batch prompts of 2,048 tokens held every later request for ~3 s while the Router tokenized them
# inline. Shorter prompts stay inline, where the thread hop would cost more than it saves.
TOKENIZE_INLINE_MAX_CHARS = 2048


class RequestPipeline:
    def __init__(self, cfg: AppConfig, tokenizer: PromptTokenizer, control: TrafficControl, lanes: LaneClients,
                 metrics, tracing: Tracing, tokenize_executor: concurrent.futures.Executor | None = None,
                 rate_limits: RateLimiter | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.control = control
        self.lanes = lanes
        self.metrics = metrics
        self.tracing = tracing
        self.recent_ttft = RecentTtft()
        # The API keys' requests and tokens per minute, app-wide (None: no key has limits).
        self.rate_limits = rate_limits
        # One thread by default: long prompts are tokenized one at a time, never concurrently on the one tokenizer.
        self.tokenize_executor = tokenize_executor or concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tokenize")

    @property
    def model(self) -> str:
        return self.cfg.model.served_name

    def new_record(self, endpoint: Endpoint | None, carrier: Mapping[str, str] | None = None) -> RequestRecord:
        return RequestRecord(self.metrics, self.tracing, carrier, endpoint.name if endpoint else "internal",
                             recent_ttft=self.recent_ttft)

    # ---- prepare -------------------------------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.model:
            raise api.OpenAIError(404, f"model {model!r} does not exist: this server serves {self.model!r}",
                                  param="model", code="model_not_found")

    def prepare(self, endpoint: Endpoint, body, class_header: str | None, record: RequestRecord,
                client_timeout_s: float | None = None, principal: Principal = OPEN_PRINCIPAL) -> RequestContext:
        """Validate, classify, tokenize once: everything before admission. Raises OpenAIError."""
        self.check_model(body.model)
        try:
            request_class = classify(body.service_tier, class_header)
        except UnknownRequestClass as error:
            raise api.OpenAIError(400, str(error), param=error.param, code="invalid_request_class") from None
        check_class(principal, request_class, "X-Request-Class header" if class_header else "service_tier")
        token_ids = self.tokenizer.token_ids(body)
        limit = self.cfg.model.max_model_len
        if len(token_ids) >= limit:
            raise api.OpenAIError(400, f"this model's maximum context length is {limit} tokens and the prompt has "
                                       f"{len(token_ids)}: shorten the prompt", param=endpoint.prompt_param,
                                  code="context_length_exceeded")
        requested = body.requested_max_tokens
        max_tokens = requested if requested is not None else min(self.cfg.router.default_max_tokens,
                                                                 limit - len(token_ids))
        lane_request = LaneRequest(
            request_id=endpoint.new_id(),
            prompt_token_ids=token_ids,
            sampling=SamplingOptions(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                     stop=body.stop_list, seed=body.seed, ignore_eos=body.ignore_eos),
            request_class=request_class,
            priority=policy_for(request_class).priority,
            stream=body.stream,
            client_timeout_s=client_timeout_s,
            trace_carrier=record.carrier(),
        )
        record.request_class = request_class
        return RequestContext(endpoint, request_class, lane_request, record, max_tokens, principal=principal)

    # ---- the whole front half --------------------------------------------------------------------------------------

    async def start(self, endpoint: Endpoint, body, *, class_header: str | None = None,
                    client_timeout_s: float | None = None, record: RequestRecord | None = None,
                    principal: Principal = OPEN_PRINCIPAL) -> "LaneCall":
        """prepare -> admit -> route -> start on the lane (its first chunk in hand). Raises OpenAIError with the
        right status; the request's outcome is counted here when it ends before its first chunk. `principal`: the
        caller its API key names (the surfaces authenticate first); batch lines run as the open principal."""
        record = record if record is not None else self.new_record(endpoint)
        try:
            with record.span_for(SPAN_CLASSIFY):
                if body.prompt_size() > TOKENIZE_INLINE_MAX_CHARS:
                    context = await asyncio.get_running_loop().run_in_executor(
                        self.tokenize_executor, self.prepare, endpoint, body, class_header, record, client_timeout_s,
                        principal)
                else:
                    context = self.prepare(endpoint, body, class_header, record, client_timeout_s, principal)
            return await self._admit_and_start(context)
        except api.OpenAIError as error:
            self._count_refusal(record, body, class_header, error.status)
            raise
        except asyncio.CancelledError:
            self._count_refusal(record, body, class_header, CLIENT_CLOSED_STATUS)
            raise
        except Exception:
            self._count_refusal(record, body, class_header, 500)
            raise

    async def _admit_and_start(self, context: RequestContext) -> "LaneCall":
        """The key's rate limits first (429 rate_limit_exceeded), then admission and the lane. A request that does
        not start gives its tokens back; one that does settles them when it ends (LaneCall)."""
        context.charge = await self._take_rate_limits(context)
        try:
            return await self._admit_and_start_on_lane(context)
        except BaseException:
            context.charge.settle(0)
            raise

    async def _take_rate_limits(self, context: RequestContext) -> Charge:
        if self.rate_limits is None:
            return NO_CHARGE
        try:
            return await self.rate_limits.admit(context.principal, len(context.lane_request.prompt_token_ids),
                                                context.max_tokens)
        except RateLimited as limited:
            raise api.OpenAIError(429, str(limited), type=limited.kind, code="rate_limit_exceeded",
                                  headers=limited.headers) from None

    async def _admit_and_start_on_lane(self, context: RequestContext) -> "LaneCall":
        request_class, record = context.request_class, context.record
        with record.span_for(SPAN_ADMIT) as span:
            admitted = self.control.admit(request_class, context.tenant)
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
            with record.span_for(SPAN_ROUTE):
                decision = self.route(context)
            timeout_s = self.control.timeout_s(request_class)
            if context.lane_request.client_timeout_s is not None:
                timeout_s = min(timeout_s, context.lane_request.client_timeout_s)
            call = LaneCall(context, timeout_s, self.control, self.lanes, self.route)
            record.decided()
            await call.start(decision)
            started = True
            self.control.started(request_class, context.tenant)
            return call
        finally:
            if not started:
                self.control.abandoned_before_start(request_class, context.tenant)
            self._publish_queue_depth(request_class)

    # ---- route -----------------------------------------------------------------------------------------------------

    def route(self, context: RequestContext, *, hot_refused_for_kv: bool = False, hot_wait_expired: bool = False,
              continuation_tokens: int = 0, max_tokens: int | None = None) -> RouteDecision:
        """The one routing decision for this request (its first start, a hot replica's refusal, or the decode
        continuation), applied to the context. Raises OpenAIError for a refusal."""
        request = context.lane_request
        decision = self.control.route(
            context.request_class, len(request.prompt_token_ids) + continuation_tokens,
            max_tokens if max_tokens is not None else context.max_tokens,
            has_stop_strings=bool(request.sampling.stop), hot_refused_for_kv=hot_refused_for_kv,
            hot_wait_expired=hot_wait_expired, continuation=continuation_tokens > 0,
            waited_s=time.monotonic() - context.record.arrived_at, tenant=context.tenant)
        if isinstance(decision, RouteRefusal):
            headers = {"Retry-After": str(decision.retry_after_s)} if decision.retry_after_s else None
            error_type = {400: "invalid_request_error", 429: "rate_limit_error"}.get(decision.status, "server_error")
            message = decision.message
            if decision.status == 429 and decision.retry_after_s:
                message += f"; retry in {decision.retry_after_s} s"
            raise api.OpenAIError(decision.status, message, code=decision.code, type=error_type,
                                  param="max_tokens" if decision.status == 400 else None, headers=headers)
        context.route = decision
        context.lane = decision.lane
        context.record.lane = decision.lane.value
        for reason in decision.reasons:
            if reason not in context.reasons:
                context.reasons.append(reason)
                self.metrics.count_degrade(reason=reason_label(reason), request_class=context.request_class)
        return decision

    # ---- answers ---------------------------------------------------------------------------------------------------

    async def collect(self, call: "LaneCall") -> dict[str, Any]:
        """The whole answer as one OpenAI response object."""
        pieces = [chunk.text async for chunk in call.chunks()]
        last = call.last
        usage = api.usage(last.prompt_tokens, last.completion_tokens, last.cached_prompt_tokens)
        return call.context.endpoint.response(call.context.request_id, self.model, "".join(pieces),
                                              last.finish_reason, usage)

    # ---- bookkeeping -----------------------------------------------------------------------------------------------

    def _publish_queue_depth(self, request_class: RequestClass) -> None:
        """The one class a request entered or left (per request: one gauge write, not one per class)."""
        self.metrics.set_queue_depth(self.control.back_pressure.queued(request_class), request_class=request_class)

    @staticmethod
    def _count_refusal(record: RequestRecord, body, class_header: str | None, status: int) -> None:
        if record.request_class is None:
            # Refused before classification (unknown model, empty prompt...): label it with the class it asked for.
            try:
                record.request_class = classify(getattr(body, "service_tier", None), class_header)
            except UnknownRequestClass:
                record.request_class = UNKNOWN_CLASS
        record.failed(status)

    def shutdown(self) -> None:
        self.tokenize_executor.shutdown(wait=False, cancel_futures=True)

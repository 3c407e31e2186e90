"""The Router's one request path: parse and render (vLLM's serving code) -> prepare -> admit -> route -> start ->
answer. A plain class, no Ray.

`RequestPipeline` is built from the OpenAI surface (app/router/openai_surface.py), the traffic control (admission,
breakers, slots, the routing decision), the lane clients, metrics and tracing; the Serve deployment only wires it.
Every surface (HTTP, gRPC, batch lines) calls `answer()` with the client's JSON body: vLLM's serving code validates
and renders it and calls `start()` for each prompt, and renders the answer from the chunks of the `LaneCall` that
`start()` returns. Each request carries one `RequestContext`: its class and lane as enums, the route decision with its
reasons, and its record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from app.classes import RequestClass, UnknownRequestClass, classify, policy_for
from app.config import AppConfig
from app.lanes.admission import AdmissionResult
from app.lanes.types import LaneRequest, SamplingOptions
from app.observability.model_labels import ModelLabels
from app.observability.tracing import SPAN_ADMIT, SPAN_CLASSIFY, SPAN_ROUTE, Tracing
from app.router import openai_api as api
from app.router.control import TrafficControl
from app.router.auth import OPEN_PRINCIPAL, Principal, check_class
from app.router.endpoints import Answer, Endpoint, Generation
from app.router.lane_call import LaneCall, LaneClients, RequestContext
from app.router.rate_limits import NO_CHARGE, Charge, RateLimited, RateLimiter
from app.router.record import CLIENT_CLOSED_STATUS, UNKNOWN_CLASS, RecentTtft, RequestRecord, reason_label
from app.router.handoff import handoff_after_tokens
from app.router.spill import RouteDecision, RouteRefusal

# x-llm-lanes-degraded: the decode handoff would have moved this request, but cannot carry what it asked for.
REASON_HANDOFF_SKIPPED = "handoff_skipped"

logger = logging.getLogger(__name__)

class RequestPipeline:
    def __init__(self, cfg: AppConfig, surface, control: TrafficControl, lanes: LaneClients, metrics,
                 tracing: Tracing, rate_limits: RateLimiter | None = None):
        """`surface`: the OpenAISurface (vLLM's serving code for this model); None where only `start()` is used."""
        self.cfg = cfg
        self.surface = surface
        self.control = control
        self.lanes = lanes
        self.metrics = metrics
        self.tracing = tracing
        self.recent_ttft = RecentTtft()
        self.model_labels = ModelLabels(cfg.model.served_name, cfg.observability.model_label_limit,
                                        [adapter.name for adapter in cfg.model.adapters])
        # The API keys' requests and tokens per minute, app-wide (None: no key has limits).
        self.rate_limits = rate_limits
        # When this replica began serving the model: its model card's `created`.
        self.serving_since = int(time.time())

    @property
    def model(self) -> str:
        return self.cfg.model.served_name

    def new_record(self, endpoint: Endpoint | None, carrier: Mapping[str, str] | None = None) -> RequestRecord:
        return RequestRecord(self.metrics, self.tracing, carrier, endpoint.name if endpoint else "internal",
                             recent_ttft=self.recent_ttft)

    # ---- prepare -------------------------------------------------------------------------------------------------

    def classify(self, service_tier: str | None, class_header: str | None, principal: Principal) -> RequestClass:
        """The request's class, if its key may use it. Raises OpenAIError (400 unknown, 403 not allowed)."""
        try:
            request_class = classify(service_tier, class_header)
        except UnknownRequestClass as error:
            raise api.OpenAIError(400, str(error), param=error.param, code="invalid_request_class") from None
        check_class(principal, request_class, "X-Request-Class header" if class_header else "service_tier")
        return request_class

    def prepare(self, endpoint: Endpoint, generation: Generation, service_tier: str | None,
                class_header: str | None, record: RequestRecord, client_timeout_s: float | None = None,
                principal: Principal = OPEN_PRINCIPAL) -> RequestContext:
        """Classify the prompt the OpenAI surface rendered: everything before admission. Raises OpenAIError."""
        record.model = self.model_labels.label(generation.adapter.name if generation.adapter else None)
        record.prompt_tokens = len(generation.prompt_token_ids)
        request_class = self.classify(service_tier, class_header, principal)
        token_ids = generation.prompt_token_ids
        limit = self.cfg.model.max_model_len
        if len(token_ids) >= limit:
            raise api.OpenAIError(400, f"this model's maximum context length is {limit} tokens and the prompt has "
                                       f"{len(token_ids)}: shorten the prompt", param=endpoint.prompt_param,
                                  code="context_length_exceeded")
        lane_request = LaneRequest(
            request_id=generation.request_id,
            prompt_token_ids=token_ids,
            sampling=SamplingOptions(max_tokens=generation.max_tokens, stop=generation.stop),
            request_class=request_class,
            priority=policy_for(request_class).priority,
            stream=generation.stream,
            client_timeout_s=client_timeout_s,
            trace_carrier=record.carrier(),
            engine_params=generation.engine_params,
            engine_kwargs=generation.engine_kwargs,
            adapter=generation.adapter,
        )
        record.request_class = request_class
        return RequestContext(endpoint, request_class, lane_request, record, generation.max_tokens,
                              handoff_blocker=generation.handoff_blocker, principal=principal)

    # ---- the whole front half --------------------------------------------------------------------------------------

    async def answer(self, endpoint: Endpoint, body: Any, *, class_header: str | None = None,
                     client_timeout_s: float | None = None, record: RequestRecord | None = None,
                     stream: bool | None = None, principal: Principal = OPEN_PRINCIPAL) -> Answer:
        """A client's JSON body -> the answer (JSON or SSE events), through vLLM's serving code with each prompt
        started here (`start`). `stream` overrides the body's (batch lines are never streamed). `principal`: the
        caller its API key names (the surfaces authenticate first); batch lines run as their batch's tenant.
        Raises OpenAIError with the right status."""
        record = record if record is not None else self.new_record(endpoint)
        service_tier = body.get("service_tier") if isinstance(body, dict) else None
        try:
            # A class the key may not use is refused before vLLM's code renders (and tokenizes) the prompt.
            request_class = self.classify(service_tier, class_header, principal)
            if isinstance(body, dict):
                self.surface.check_bounds(endpoint, body)
                if stream is not None:
                    body = {**body, "stream": stream}
            request = self.surface.parse(endpoint, body)
            self._check_model(request, principal)
            self._refuse_before_render(endpoint, body, request, request_class, principal)
        except api.OpenAIError as error:
            self.count_refusal(record, service_tier, class_header, error.status)
            raise
        records = iter([record])

        async def launch(generation: Generation) -> LaneCall:
            # A completion with several prompts starts one lane call per prompt, each with a record of its own.
            return await self.start(endpoint, generation, service_tier=service_tier, class_header=class_header,
                                    client_timeout_s=client_timeout_s,
                                    record=next(records, None) or self.new_record(endpoint), principal=principal)

        try:
            return await self.surface.answer(endpoint, request, launch)
        except api.OpenAIError as error:
            if not record.finished and record.request_class is None:
                # Refused by vLLM's serving code before any prompt started (model, template, parameters).
                self.count_refusal(record, service_tier, class_header, error.status)
            raise

    async def start(self, endpoint: Endpoint, generation: Generation, *, service_tier: str | None = None,
                    class_header: str | None = None, client_timeout_s: float | None = None,
                    record: RequestRecord | None = None, principal: Principal = OPEN_PRINCIPAL) -> "LaneCall":
        """prepare -> admit -> route -> start on the lane (its first chunk in hand). Raises OpenAIError with the
        right status; the request's outcome is counted here when it ends before its first chunk. `principal`: the
        caller its API key names (the surfaces authenticate first); batch lines run as the open principal."""
        record = record if record is not None else self.new_record(endpoint)
        try:
            with record.span_for(SPAN_CLASSIFY):
                context = self.prepare(endpoint, generation, service_tier, class_header, record, client_timeout_s,
                                       principal)
            return await self._admit_and_start(context)
        except api.OpenAIError as error:
            self.count_refusal(record, service_tier, class_header, error.status)
            raise
        except asyncio.CancelledError:
            self.count_refusal(record, service_tier, class_header, CLIENT_CLOSED_STATUS)
            raise
        except Exception:
            self.count_refusal(record, service_tier, class_header, 500)
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
            raise self._queue_full_error(request_class, admitted)
        record.admitted(request_class)
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

    # ---- route -----------------------------------------------------------------------------------------------------

    def route(self, context: RequestContext, *, hot_refused_for_kv: bool = False, hot_wait_expired: bool = False,
              continuation_tokens: int = 0, max_tokens: int | None = None) -> RouteDecision:
        """The one routing decision for this request (its first start, a hot replica's refusal, or the decode
        continuation), applied to the context. Raises OpenAIError for a refusal."""
        request = context.lane_request
        decision = self.control.route(
            context.request_class, len(request.prompt_token_ids) + continuation_tokens,
            max_tokens if max_tokens is not None else context.max_tokens,
            has_stop_strings=bool(request.sampling.stop) or context.handoff_blocker is not None,
            hot_refused_for_kv=hot_refused_for_kv,
            hot_wait_expired=hot_wait_expired, continuation=continuation_tokens > 0,
            waited_s=time.monotonic() - context.record.arrived_at, tenant=context.tenant)
        if isinstance(decision, RouteRefusal):
            raise self._route_refusal_error(decision)
        if (context.handoff_blocker not in (None, "stop") and continuation_tokens == 0
                and REASON_HANDOFF_SKIPPED not in context.reasons
                and handoff_after_tokens(request_class=context.request_class, lane=decision.lane,
                                         prompt_tokens=len(request.prompt_token_ids), max_tokens=decision.max_tokens,
                                         has_stop_strings=False,
                                         handoff_tokens=self.cfg.admission.interactive_decode_handoff_tokens,
                                         lane_caps=self.control.lane_caps) is not None):
            # The decode handoff would have taken it, but its continuation could not answer the same: it stays.
            decision = replace(decision, reasons=(*decision.reasons, REASON_HANDOFF_SKIPPED))
        context.route = decision
        context.lane = decision.lane
        context.record.lane = decision.lane.value
        for reason in decision.reasons:
            if reason not in context.reasons:
                context.reasons.append(reason)
                self.metrics.count_degrade(reason=reason_label(reason), request_class=context.request_class)
        return decision

    # ---- refusals ---------------------------------------------------------------------------------------------------

    def _check_model(self, request, principal: Principal) -> None:
        """An adapter the key may not use is a model that does not exist, for that key (vLLM's server's 404)."""
        name = getattr(request, "model", None)
        if not principal.may_use_model(name, self.model):
            raise api.OpenAIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def _refuse_before_render(self, endpoint: Endpoint, body: Any, request, request_class: RequestClass,
                              principal: Principal) -> None:
        """Raise the 429 that admission or the routing decision would give this request whatever its exact prompt,
        before vLLM's code renders and tokenizes it: under a retry storm refusals are most of the requests, and each
        must cost the Router almost nothing next to the streams it is writing. A request whose sampling parameters
        vLLM refuses gets that 400 instead, and one naming a model not served here its 404 (the client's mistake,
        which no retry mends)."""
        if not isinstance(body, dict):
            return
        max_tokens = api.requested_max_tokens(body, self.cfg.router.default_max_tokens)
        refusal = self.control.refusal_before_render(
            request_class, api.prompt_tokens_bound(body, chat=endpoint.chat), max_tokens, principal.tenant)
        if refusal is None:
            return
        if not self.surface.serves_model(getattr(request, "model", None)):
            return  # vLLM's code answers its 404 model_not_found, which no retry mends either
        self.surface.check_sampling(endpoint, request, max_tokens)
        if isinstance(refusal, AdmissionResult):
            self.metrics.count_admission(decision="reject", reason=reason_label(refusal.reason),
                                         request_class=request_class)
            raise self._queue_full_error(request_class, refusal)
        if refusal is not None:
            raise self._route_refusal_error(refusal)

    @staticmethod
    def _queue_full_error(request_class: RequestClass, refused: AdmissionResult) -> api.OpenAIError:
        return api.OpenAIError(429, f"too many {request_class.value} requests are waiting ({refused.reason}); "
                                    f"retry in {refused.retry_after_s} s", type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": str(refused.retry_after_s)})

    @staticmethod
    def _route_refusal_error(decision: RouteRefusal) -> api.OpenAIError:
        headers = {"Retry-After": str(decision.retry_after_s)} if decision.retry_after_s else None
        error_type = {400: "invalid_request_error", 429: "rate_limit_error"}.get(decision.status, "server_error")
        message = decision.message
        if decision.status == 429 and decision.retry_after_s:
            message += f"; retry in {decision.retry_after_s} s"
        return api.OpenAIError(decision.status, message, code=decision.code, type=error_type,
                               param="max_tokens" if decision.status == 400 else None, headers=headers)

    # ---- bookkeeping -----------------------------------------------------------------------------------------------

    @staticmethod
    def count_refusal(record: RequestRecord, service_tier: Any, class_header: str | None, status: int) -> None:
        if record.finished:
            return
        if record.request_class is None:
            # Refused before classification (unknown model, empty prompt...): label it with the class it asked for,
            # or "unknown" when that is what was wrong (a class name that is not one, a list or an object).
            try:
                record.request_class = classify(service_tier, class_header)
            except UnknownRequestClass:
                record.request_class = UNKNOWN_CLASS
        record.failed(status)

    def shutdown(self) -> None:
        pass

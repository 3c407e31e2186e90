"""One request on its lane(s) at the Router: the context it carries, the slot its route decision takes, the lane call
under the class deadline, the decode handoff's continuation, and the outcome recorded once. No Ray.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from app.classes import Lane, RequestClass
from app.lanes.types import LaneChunk, LaneReplicaLost, LaneRequest, LaneRequestInvalid, LaneSaturated
from app.router import openai_api as api
from app.router.auth import OPEN_PRINCIPAL, Principal
from app.router.control import TrafficControl
from app.router.rate_limits import NO_CHARGE, Charge
from app.router.read_ahead import ReadAhead
from app.router.endpoints import Endpoint
from app.router.record import CLIENT_CLOSED_STATUS, RequestRecord
from app.router.slot_waiters import SlotWaitAbandoned
from app.router.spill import RouteDecision

logger = logging.getLogger(__name__)

# A request whose lane replica is lost before its first chunk is decided and started again, this many times: Serve
# takes the dead replica out of rotation at its first error, so a retry reaches another replica, or waits in the
# handle for the replacement. More losses in a row are a lane going down as a whole, which its breaker answers.
LANE_LOSS_RETRIES = 2
# How often a call waiting for its first chunk looks whether its lane still has a replica.
LANE_DOWN_CHECK_S = 0.5
# The pause before a call lost with its replica is started again: Serve's handle learns of a dead replica from the
# controller, and a call made at once can reach the same replica (three flex requests failed so within 0.7 s of a
# cold replica's kill). Batch work, which waits for its lane (spill.py, rule 6a), is started again after
# BATCH_LANE_LOSS_WAIT_S as often as its deadline allows, not LANE_LOSS_RETRIES times.
LANE_LOSS_BACKOFF_S = 0.25
BATCH_LANE_LOSS_WAIT_S = 1.0


class LaneStream(Protocol):
    """One lane call's chunks (a Serve DeploymentResponseGenerator, or a fake in tests)."""

    def __anext__(self): ...

    def cancel(self) -> None: ...


class LaneClients(Protocol):
    def open(self, lane: Lane, request: LaneRequest) -> LaneStream: ...


@dataclass
class RequestContext:
    """One request at the Router: what it asked for, its class, and where the routing decision sent it."""

    endpoint: Endpoint
    request_class: RequestClass
    lane_request: LaneRequest
    record: RequestRecord
    # The answer's length the client is owed (its max_tokens, or the default): decisions clip it, handoffs split it.
    max_tokens: int
    # Set by route(): the decision, the lane it names, and every reason that moved or changed the request.
    route: RouteDecision | None = None
    lane: Lane | None = None
    reasons: list[str] = field(default_factory=list)
    # Who sent it (its API key's tenant, classes and limits).
    principal: Principal = OPEN_PRINCIPAL
    # What it took from its key's rate limits (settled when it ends), and their x-ratelimit-* headers.
    charge: Charge = field(default_factory=lambda: NO_CHARGE)

    @property
    def tenant(self) -> str:
        return self.principal.tenant
    # Why a decode handoff cannot carry this request's answer (n > 1, logprobs...): None when it can.
    handoff_blocker: str | None = None

    @property
    def request_id(self) -> str:
        return self.lane_request.request_id

    def headers(self, replica_id: str | None, lane: Lane | None = None) -> dict[str, str]:
        """The answer's x-llm-lanes-* headers; `lane`: the lane that started it (default: the current one)."""
        headers = {"x-llm-lanes-lane": (lane or self.lane).value, "x-llm-lanes-request-class": self.request_class.value}
        if replica_id:
            # Which engine replica serves it: lets operators (and the prefix-affinity tests) see routing.
            headers["x-llm-lanes-replica"] = replica_id
        if self.reasons:
            headers["x-llm-lanes-degraded"] = ",".join(self.reasons)
        headers.update(self.charge.headers)
        return headers


class LaneCall:
    """One request on its lane(s): start (first chunk), then chunks under the class deadline, then bookkeeping once.

    It holds the slot its route decision takes (a hot-lane slot, or cold-lane spill room) until it ends on that lane.
    Cancellation anywhere (client gone, deadline) cancels the lane call, which aborts the engine request.
    """

    def __init__(self, context: RequestContext, timeout_s: float, control: TrafficControl, lanes: LaneClients,
                 route: Callable[..., RouteDecision]):
        """`route(context, **inputs)` is the pipeline's routing decision, taken again on a lane's refusal, an expired
        wait for a hot slot, and the decode continuation."""
        self.control = control
        self.lanes = lanes
        self.route = route
        self.context = context
        self.timeout_s = timeout_s
        self.started_at = time.monotonic()
        self.deadline = self.started_at + timeout_s
        # The client asked for a deadline shorter than its class's: when it passes, that is the client's choice.
        client_timeout_s = context.lane_request.client_timeout_s
        self._deadline_is_clients = client_timeout_s is not None and client_timeout_s <= timeout_s
        self.stream: LaneStream | None = None
        self.last: LaneChunk | None = None
        self._first: LaneChunk | None = None
        self._started_on: Lane | None = None
        self._lane_done = False  # the current lane call's outcome is recorded
        self._slot: tuple[Any, int] | None = None  # (LaneSlots, token) held now
        # Decode handoff: the hot part's tokens (the continuation's prompt suffix) and where the answer stands.
        self._handoff_after: int | None = None
        self._handed_off_ids: list[int] = []
        self._handoff_due = False
        self._continued = False
        # A stream whose lane replica is lost mid-answer goes on elsewhere from the tokens the client has (a
        # continuation, as the decode handoff's): the current lane call's token ids, and the resumptions so far.
        self._prompt_ids = context.lane_request.prompt_token_ids
        self._call_ids: list[int] = []
        self._resumed = 0
        # A streamed answer holding a hot slot is read from its lane ahead of the client: the slot is the engine's,
        # and the engine is done at the lane's last chunk, however slowly the client reads (app/router/read_ahead.py).
        self._ahead: ReadAhead | None = None

    @property
    def request_class(self) -> RequestClass:
        return self.context.request_class

    @property
    def lane(self) -> Lane:
        return self.context.lane

    def headers(self) -> dict[str, str]:
        first = self._first or self.last
        return self.context.headers(first.replica_id if first is not None else None, self._started_on)

    def _remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def _next_chunk(self) -> LaneChunk:
        """The lane's next chunk, or TimeoutError at the deadline. A timeout scope, not asyncio.wait_for: wait_for
        (Python 3.11) wraps every chunk's await in a task of its own, one more trip through the event loop each."""
        async with asyncio.timeout(self._remaining()):  # relative: the loop's clock need not be time.monotonic
            if self._ahead is None:
                return await anext(self.stream)
            chunk, error = await self._ahead.get()
        if error is not None or chunk.finish_reason is not None:
            # The lane call read ahead is over: a continuation or resumption that follows is read directly.
            self._ahead = None
        if error is not None:
            raise error
        return chunk

    # ---- start -----------------------------------------------------------------------------------------------------

    async def start(self, decision: RouteDecision) -> None:
        try:
            self._first = await self._start_surviving_losses(decision)
        except LaneSaturated:
            # The hot replica keeps its KV headroom for realtime: the refusal is an input of a new decision.
            self._end_lane_call(ok=None)
            self.control.hot_refused_for_kv()
            decision = self.route(self.context, hot_refused_for_kv=True)
            if decision.lane is Lane.HOT:
                raise api.OpenAIError(503, "both lanes are saturated or failing; retry shortly", type="server_error",
                                      code="lanes_saturated", headers={"Retry-After": "1"}) from None
            self._first = await self._start_surviving_losses(decision)
        except BaseException:
            self._release_slot(record_hold=False)
            raise
        self.last = self._first
        # The lane that started the answer: the one its headers name, also once a decode handoff's continuation has
        # moved the request on (the headers of a collected answer are made after the continuation).
        self._started_on = self.context.lane
        # A streamed request's first chunk is its first token (a non-streamed one's is its whole answer).
        if self._slot is not None:
            self._slot[0].first_token(self._slot[1])
        self._lane_finished_with(self._first)
        if self._handoff_due:
            # The hot part of a decode handoff ended at its first chunk: its engine sequence is done.
            self._release_slot(record_hold=True)
        if self._slot is not None and self._slot[0] is self.control.hot_slots:
            self._ahead = ReadAhead(self.stream, lambda: self._release_slot(record_hold=True))
        self.context.record.first_chunk(streamed=self.context.lane_request.stream)

    async def _start_surviving_losses(self, decision: RouteDecision) -> LaneChunk:
        """_start_on, again on a new decision when the replica is lost before the first chunk: nothing reached the
        client yet, so the request is not lost with it. The loss counts against the lane's breaker, so the new
        decision may move the request to the other lane."""
        waits_for_lane = self.request_class is RequestClass.BATCH
        pause_s = BATCH_LANE_LOSS_WAIT_S if waits_for_lane else LANE_LOSS_BACKOFF_S
        retry = 0
        while True:
            try:
                return await self._start_on(decision)
            except LaneReplicaLost as error:
                if (retry == LANE_LOSS_RETRIES and not waits_for_lane) or self._remaining() <= pause_s:
                    raise self._as_openai_error(error) from None
                retry += 1
                logger.warning("request %s: its %s lane replica was lost before the first token; starting it again",
                               self.context.request_id, self.lane.value)
                await asyncio.sleep(pause_s)
                decision = self.route(self.context)

    async def _start_on(self, decision: RouteDecision) -> LaneChunk:
        """Take the decision's slot (waiting for a hot slot as long as the TTFT target and the deadline allow; past
        that, the request is decided again), then open the lane call."""
        while decision.wait_for_lane_s > 0:
            # Its lane's breaker refuses now (spill.py rule 6a: batch waits for the cold lane): wait, decide again.
            if decision.wait_for_lane_s >= self._remaining():
                lane = decision.lane.value
                raise api.OpenAIError(503, f"the {lane} lane is failing and does not take requests again before "
                                           f"this request's deadline; retry later", type="server_error",
                                      code=f"{lane}_breaker_open",
                                      headers={"Retry-After": str(math.ceil(decision.wait_for_lane_s))})
            await asyncio.sleep(decision.wait_for_lane_s)
            decision = self.route(self.context)
        self._lane_done = False
        streamed = self.context.lane_request.stream
        if decision.takes_hot_slot:
            slots = self.control.hot_slots
            if slots.free(self.context.tenant) > 0:
                # The common case, taken without a task or a trip through the event loop.
                token = slots.take(awaits_first_token=streamed, tenant=self.context.tenant)
            else:
                arrived_at = self.context.record.arrived_at

                def hot_wait_budget_s() -> float:
                    return self.control.hot_wait_budget_s(time.monotonic() - arrived_at)

                budget_s = hot_wait_budget_s() if decision.wait_for_hot_slot else self._remaining()
                # The budget is worked out again while waiting: the lane's time from a slot to the first token
                # can grow meanwhile (a burst slows prefill), and a request that can no longer start within the
                # TTFT target leaves the line for a new decision instead of taking a slot late.
                give_up = (lambda: hot_wait_budget_s() <= 0) if decision.wait_for_hot_slot else None
                try:
                    token = await asyncio.wait_for(slots.acquire(self.context.tenant, streamed, give_up),
                                                   timeout=min(budget_s, self._remaining()))
                except (asyncio.TimeoutError, SlotWaitAbandoned):
                    if self._remaining() <= 0:
                        raise self._deadline_error() from None
                    decision = self.route(self.context, hot_wait_expired=True)
                    return await self._start_on(decision)
            self._slot = (slots, token)
        elif decision.takes_cold_spill:
            self._slot = (self.control.cold_spill, self.control.cold_spill.take(awaits_first_token=streamed))
        if not self.control.allow(decision.lane):
            raise api.OpenAIError(503, f"the {decision.lane.value} lane is failing; retry shortly", type="server_error",
                                  code=f"{decision.lane.value}_breaker_open", headers={"Retry-After": "1"})
        request = self.context.lane_request
        self._handoff_after = decision.handoff_after
        sampling = replace(request.sampling, max_tokens=decision.handoff_after or decision.max_tokens)
        self.context.lane_request = replace(
            request, priority=decision.priority, sampling=sampling,
            may_spill=self.control.may_spill(self.request_class, decision.lane),
            return_token_ids=decision.handoff_after is not None or self._resumable())
        self._requested_max_tokens = decision.max_tokens
        return await self._open_stream()

    async def _open_stream(self) -> LaneChunk:
        try:
            # Inside the try: the handle itself can refuse (no replica yet, back-pressure) before any chunk.
            self.stream = self.lanes.open(self.lane, self.context.lane_request)
            return self._client_view(await self._first_chunk())
        except LaneSaturated:
            self.stream.cancel()
            raise
        except LaneReplicaLost as error:
            self._fail(error)
            raise  # _start_surviving_losses starts it again
        except BaseException as error:
            self._fail(error)
            raise self._as_openai_error(error) from None

    async def _first_chunk(self) -> LaneChunk:
        """The lane's first chunk, or LaneReplicaLost once its lane has no replica left and the other lane would
        serve it: a call that reached Serve's handle before the Router knew the lane was down would wait there for
        the replacement (tens of seconds while an engine loads) instead of being decided again (spill.py, rule 6)."""
        async with asyncio.timeout(self._remaining()):
            pending = asyncio.ensure_future(anext(self.stream))
            try:
                while True:
                    done, _ = await asyncio.wait((pending,), timeout=LANE_DOWN_CHECK_S)
                    if done:
                        return pending.result()
                    if self._served_elsewhere(self.control.lanes_down()):
                        # Not the lane's failure to count (its breaker): the call leaves a lane without replicas.
                        self._end_lane_call(ok=None)
                        raise LaneReplicaLost(f"the {self.lane.value} lane has no replica left")
            finally:
                if not pending.done():
                    pending.cancel()
                elif not pending.cancelled():
                    pending.exception()  # retrieved: a left call's error is not logged as "never retrieved"

    def _served_elsewhere(self, lanes_down: frozenset[Lane]) -> bool:
        """Its lane has no replica and the other lane is known to have one, and would take this class there
        (spill.py, rule 6): batch work waits for its own lane, and where the other lane has none (or none known yet:
        an app starting) the handle is where to wait."""
        other = Lane.COLD if self.lane is Lane.HOT else Lane.HOT
        return (self.lane in lanes_down and other in self.control.lane_caps
                and (self.control.routable_replicas(other) or 0) > 0
                and self.request_class is not RequestClass.BATCH)

    # ---- stream ----------------------------------------------------------------------------------------------------

    async def chunks(self) -> AsyncIterator[LaneChunk]:
        record = self.context.record
        try:
            if self._first is not None:
                yield self._first
            while self.last.finish_reason is None:
                try:
                    if self._handoff_due:
                        self._continue_elsewhere()
                    chunk = self._client_view(await self._next_chunk())
                except StopAsyncIteration:
                    break
                except BaseException as error:
                    self._fail(error)
                    if isinstance(error, LaneReplicaLost) and self._resumed < LANE_LOSS_RETRIES \
                            and self._resumable() and self._remaining() > 0:
                        self._resume_elsewhere()
                        continue
                    converted = self._as_openai_error(error)
                    record.failed(converted.status if isinstance(converted, api.OpenAIError)
                                  else CLIENT_CLOSED_STATUS, self._output_tokens())
                    raise converted from None
                self.last = chunk
                self._lane_finished_with(chunk)
                yield chunk
            self._end_lane_call(ok=True, e2e_s=time.monotonic() - self.started_at)
            record.succeeded(self._output_tokens())
        finally:
            # Done, failed or abandoned by the client: cancelling the lane call aborts the engine request.
            if self._ahead is not None:
                self._ahead.stop()
                self._ahead = None
            self.stream.cancel()
            self.context.charge.settle(self._output_tokens())
            # Abandoned mid-stream by the client: no outcome for the lane, and no E2E sample for the deadline P99.
            self._end_lane_call(ok=None)
            if not record.finished:
                record.failed(CLIENT_CLOSED_STATUS, self._output_tokens())

    def _client_view(self, chunk: LaneChunk) -> LaneChunk:
        """A chunk from the lane, as the client sees it: the continuation's counts go on from the hot part's, and
        the hot part's last chunk is not final when the cold lane is to go on."""
        if self._continued:
            self._call_ids.extend(chunk.token_ids)
            return replace(chunk, completion_tokens=chunk.completion_tokens + len(self._handed_off_ids),
                           prompt_tokens=len(self._prompt_ids), cached_prompt_tokens=self._first.cached_prompt_tokens)
        if self._handoff_after is None:
            self._call_ids.extend(chunk.token_ids)
            return chunk
        self._handed_off_ids.extend(chunk.token_ids)
        if chunk.finish_reason == "length" and chunk.completion_tokens == self._handoff_after:
            # The hot lane stopped at the handoff point, not at the client's limit (EOS or max_tokens): go on.
            self._handoff_due = True
            return replace(chunk, finish_reason=None, token_ids=())
        return replace(chunk, token_ids=())

    def _continue_elsewhere(self) -> None:
        """The rest of the answer, where the routing decision for a continuation sends it."""
        self._handoff_due = False
        # The hot part succeeded; the request's end-to-end sample is taken once, when the continuation ends.
        self._end_lane_call(ok=True)
        self.stream.cancel()
        done = len(self._handed_off_ids)
        remaining = self._requested_max_tokens - done
        decision = self.route(self.context, continuation_tokens=done, max_tokens=remaining)
        self._open_continuation(decision, remaining, "decode")

    def _resumable(self) -> bool:
        """A stream whose answer a continuation carries exactly (as the decode handoff's: one choice, no logprobs,
        seed, penalties, structured output or stop strings)."""
        return self.context.lane_request.stream and self.context.handoff_blocker is None

    def _resume_elsewhere(self) -> None:
        """Its lane replica was lost mid-answer (the failure is recorded): the rest of the answer from the tokens the
        client has, where the routing decision for a continuation sends it. The client sees a pause, not an error."""
        self._resumed += 1
        self._handed_off_ids = [*self._handed_off_ids, *self._call_ids]
        self._call_ids = []
        self._handoff_after = None
        self._handoff_due = False
        done = len(self._handed_off_ids)
        remaining = self._requested_max_tokens - done
        logger.warning("request %s: its %s lane replica was lost after %d tokens; resuming it", self.context.request_id,
                       self.lane.value, done)
        decision = self.route(self.context, continuation_tokens=done, max_tokens=remaining)
        self._open_continuation(decision, remaining, f"resumed{self._resumed}")

    def _open_continuation(self, decision: RouteDecision, remaining: int, label: str) -> None:
        """The rest of the answer as a new lane call: the client's prompt and every token it has, `remaining` more."""
        request = self.context.lane_request
        self.context.lane_request = replace(
            request, request_id=f"{request.request_id}-{label}", priority=decision.priority,
            prompt_token_ids=[*self._prompt_ids, *self._handed_off_ids],
            sampling=replace(request.sampling, max_tokens=remaining), may_spill=False,
            return_token_ids=self._resumable())
        self._continued = True
        self._handoff_after = None
        self._lane_done = False
        self.stream = self.lanes.open(self.lane, self.context.lane_request)

    # ---- endings ---------------------------------------------------------------------------------------------------

    def _output_tokens(self) -> int:
        return self.last.completion_tokens if self.last is not None else 0

    def _lane_finished_with(self, chunk: LaneChunk) -> None:
        """The lane sent its last chunk: its engine slot is free now, whenever the client reads the rest (a slow
        reader must not keep an idle engine slot taken)."""
        if chunk.finish_reason is not None:
            self._release_slot(record_hold=True)

    def _release_slot(self, record_hold: bool) -> None:
        if self._slot is not None:
            slots, token = self._slot
            self._slot = None
            slots.release(token, record_hold=record_hold)

    def _end_lane_call(self, ok: bool | None, e2e_s: float | None = None, record_hold: bool = True) -> None:
        """The current lane call is over: free its slot and record its outcome, once. `ok` None: the call ended
        without an outcome for the lane (the client left or erred, a replica handed it back)."""
        self._release_slot(record_hold=record_hold and ok is True)
        if self._lane_done:
            return
        self._lane_done = True
        self.control.finished(self.request_class, self.lane, ok=ok, e2e_s=e2e_s)

    def _fail(self, error: BaseException) -> None:
        if self.stream is not None:
            self.stream.cancel()
        if isinstance(error, asyncio.CancelledError):
            return  # the client went away: not the lane's fault
        if not self._lane_failed(error):
            # The lane answered: it refused the client's request, or the client's own deadline passed. No breaker
            # counts it either way and no E2E sample is taken, as for a request the client abandoned.
            self._end_lane_call(ok=None)
            return
        logger.warning("request %s on the %s lane failed: %r", self.context.request_id, self.lane.value, error)
        self._end_lane_call(ok=False)

    def _lane_failed(self, error: BaseException) -> bool:
        """Whether `error` is the lane's failure (engine or replica: crash, lost actor, the class deadline), the
        only kind its breaker counts; a request the engine refuses as invalid is the client's error."""
        if isinstance(error, LaneRequestInvalid):
            return False
        if isinstance(error, asyncio.TimeoutError):
            return not self._deadline_is_clients
        return True

    def _deadline_error(self) -> api.OpenAIError:
        whose = ("of its X-Request-Timeout header" if self._deadline_is_clients
                 else f"for the {self.request_class.value} class")
        return api.OpenAIError(504, f"the request exceeded its {self.timeout_s:.3g} s deadline {whose} and was "
                                    f"aborted", type="timeout_error", code="deadline_exceeded")

    def _as_openai_error(self, error: BaseException) -> BaseException:
        if isinstance(error, asyncio.CancelledError):
            return error
        if isinstance(error, asyncio.TimeoutError):
            return self._deadline_error()
        if isinstance(error, LaneRequestInvalid):
            # Read through Ray's wrapper to the lane's error: its str() is Ray's traceback, not the message.
            return api.OpenAIError(400, error.message, param=error.param, code="invalid_value")
        if isinstance(error, LaneReplicaLost):
            return api.OpenAIError(503, f"the {self.lane.value} lane replica serving this request was lost; retry",
                                   type="server_error", code="lane_unavailable", headers={"Retry-After": "1"})
        return api.OpenAIError(503, f"the {self.lane.value} lane could not serve the request; retry shortly",
                               type="server_error", code="lane_unavailable", headers={"Retry-After": "1"})

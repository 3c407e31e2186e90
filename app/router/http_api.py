"""The OpenAI HTTP surface: chat and completions (JSON or SSE), models, health and the admin endpoints.

Thin: every generation goes through the RequestPipeline. `HttpApi` is a plain class whose methods become FastAPI
routes on the Router deployment (HTTP_ROUTES, attached by app/router/deployment.py); it expects the deployment to
set `pipeline`, `lane_replicas`, `prefix_cache`, `refresh_replica_counts()` and `admin_stats()`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.classes import REQUEST_CLASS_HEADER
from app.prefix_cache.index import block_hashes
from app.router import openai_api as api
from app.router.arrival_stamp import ARRIVAL_HEADER, proxy_wait_s
from app.router.auth import AUTHORIZATION_HEADER, Principal, require_admin
from app.router.body_limit import BodySizeLimit
from app.router.endpoints import CHAT, COMPLETION, Endpoint
from app.router.pipeline import RequestPipeline
from app.router.replica_counts import health_response

logger = logging.getLogger(__name__)

# A client may ask for a shorter deadline than its class's (never a longer one), in seconds.
REQUEST_TIMEOUT_HEADER = "x-request-timeout"


def client_timeout(value: str | None) -> float | None:
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


async def read_json_body(request: Request, max_bytes: int) -> Any:
    """The request's JSON body, refused with 413 past `max_bytes` (router.max_request_bytes) before it is all read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    received = bytearray()
    async for piece in request.stream():
        received += piece
        if len(received) > max_bytes:
            raise _too_large(max_bytes)
    try:
        return json.loads(received)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise api.OpenAIError(400, f"request body is not valid JSON: {error}", code="invalid_json") from None


def _too_large(max_bytes: int) -> api.OpenAIError:
    return api.OpenAIError(413, f"the request body is over this server's limit of {max_bytes} bytes "
                                f"(router.max_request_bytes)", code="request_too_large")


def openai_error_response(error: api.OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def refuse_unknown_query_parameters(request: Request) -> None:
    """A query parameter the route does not declare is refused naming it (400 `unrecognized_argument`), not ignored:
    `POST /v1/chat/completions?stream=true` would otherwise answer unstreamed as if asked."""
    if not request.scope.get("query_string"):
        return
    route = request.scope.get("route")
    declared = {param.alias for param in route.dependant.query_params} if route is not None else set()
    unknown = {name: value for name, value in request.query_params.items() if name not in declared}
    if unknown:
        raise api.unrecognized_arguments(unknown, honoured=frozenset(), completion_request=False)


# OpenAI's endpoints that the Router serves, for the answer to a request for one it does not.
_SERVED = ("POST /v1/chat/completions, POST /v1/completions, GET /v1/models, /v1/files and /v1/batches (OpenAI's), "
           "POST /tokenize, /detokenize, /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's)")


def make_http_app(extra_error_types: dict[type[Exception], Any] | None = None) -> FastAPI:
    """The FastAPI app with OpenAI-shaped errors for everything: never a stack trace to the client.
    `extra_error_types` maps other exception types (e.g. the batch store's) to an OpenAIError factory."""
    app = FastAPI(title="llm-lanes", docs_url="/docs", openapi_url="/openapi.json",
                  dependencies=[Depends(refuse_unknown_query_parameters)])
    app.add_middleware(BodySizeLimit)

    @app.exception_handler(api.OpenAIError)
    async def _openai_error(_: Request, error: api.OpenAIError) -> JSONResponse:
        return openai_error_response(error)

    for error_type, to_openai in (extra_error_types or {}).items():
        async def _mapped(_: Request, error: Exception, to_openai=to_openai) -> JSONResponse:
            return openai_error_response(to_openai(error))

        app.add_exception_handler(error_type, _mapped)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return openai_error_response(api.validation_error(list(error.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message, headers = str(error.detail), dict(error.headers or {})
        if error.status_code == 404:
            # A client of another OpenAI endpoint (/v1/responses, /v1/embeddings) learns which ones are here.
            message = (f"{message}: {request.method} {request.url.path} is not an endpoint of this server; it serves "
                       f"{_SERVED} (GET /openapi.json lists every route)")
        elif error.status_code == 405 and "Allow" in headers:
            message = f"{message}: {request.url.path} takes {headers['Allow']}, not {request.method}"
        return openai_error_response(api.OpenAIError(error.status_code, message, headers=headers,
                                                     code="not_found" if error.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _unexpected_error(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error")  # the log has the stack trace, the client does not
        return openai_error_response(api.OpenAIError(500, "internal server error", type="server_error"))

    return app


ROUTER_REPLICA_HEADER = "x-llm-lanes-router"


class HttpApi:
    pipeline: RequestPipeline
    # This Router replica's id (Serve's unique replica id), sent with every generated answer; None outside Serve.
    router_replica_id: str | None = None

    def authenticate_http(self, request: Request, admin: bool = False) -> Principal:
        """The caller of an HTTP request, from its `Authorization: Bearer` key (401, or 403 for a non-admin key
        on an admin endpoint). The key ring is the deployment's."""
        principal = self.keyring.authenticate(request.headers.get(AUTHORIZATION_HEADER))
        if admin:
            require_admin(principal)
        return principal

    async def health(self) -> JSONResponse:
        """For a load balancer: 503 while the hot lane has no running replica (replica_counts.health_response).
        The counts are this replica's last read (every few seconds): a 503 is read again first, so a replica that
        started before the hot lane's replica ran does not answer 503 after it runs."""
        status_code, body = health_response(self.lane_replicas)
        if status_code != 200:
            await self.refresh_replica_counts()
            status_code, body = health_response(self.lane_replicas)
        return JSONResponse(body, status_code=status_code)

    async def models(self, request: Request) -> dict[str, Any]:
        principal = self.authenticate_http(request)
        return {"object": "list", "data": await self._model_cards(principal)}

    async def model(self, model_id: str, request: Request) -> dict[str, Any]:
        principal = self.authenticate_http(request)
        card = next((card for card in await self._model_cards(principal) if card["id"] == model_id), None)
        if card is None:
            raise api.OpenAIError(404, f"model {model_id!r} does not exist: this server serves "
                                       f"{self.pipeline.model!r} and its adapters (GET /v1/models)", param="model",
                                  code="model_not_found")
        return card

    async def _model_cards(self, principal: Principal) -> list[dict[str, Any]]:
        """The base model's card, then its LoRA adapters' as vLLM's server lists them (parent: the base model): those
        the caller's key may use."""
        adapters = [card for card in await self.pipeline.surface.model_cards()
                    if card.get("parent") and principal.may_use_model(card["id"], self.pipeline.model)]
        return [self._model_card()] + [{**card, "created": self.pipeline.serving_since, "owned_by": "llm-lanes",
                                        "max_model_len": self.pipeline.cfg.model.max_model_len} for card in adapters]

    def _model_card(self) -> dict[str, Any]:
        model = self.pipeline.cfg.model
        return {"id": model.served_name, "object": "model", "created": self.pipeline.serving_since,
                "owned_by": "llm-lanes", "root": model.source, "max_model_len": model.max_model_len}

    async def version(self) -> dict[str, Any]:
        return {"version": self.pipeline.surface.vllm_version}

    async def tokenize(self, request: Request) -> dict[str, Any]:
        self.authenticate_http(request)
        body = await read_json_body(request, self.pipeline.cfg.router.max_request_bytes)
        return await self.pipeline.surface.tokenize(body)

    async def detokenize(self, request: Request) -> dict[str, Any]:
        self.authenticate_http(request)
        body = await read_json_body(request, self.pipeline.cfg.router.max_request_bytes)
        return await self.pipeline.surface.detokenize(body)

    async def chat_completions(self, request: Request):
        return await self._generate(CHAT, request)

    async def completions(self, request: Request):
        return await self._generate(COMPLETION, request)

    async def _generate(self, endpoint: Endpoint, request: Request):
        pipeline = self.pipeline
        principal = self.authenticate_http(request)
        record = pipeline.new_record(endpoint, request.headers if pipeline.tracing.enabled else None)
        record.waited_at_proxy(proxy_wait_s(request.headers.get(ARRIVAL_HEADER), time.time()))
        try:
            body = await read_json_body(request, pipeline.cfg.router.max_request_bytes)
            record.received()
        except api.OpenAIError as error:
            pipeline.count_refusal(record, None, request.headers.get(REQUEST_CLASS_HEADER), error.status)
            raise
        answer = await pipeline.answer(endpoint, body, class_header=request.headers.get(REQUEST_CLASS_HEADER),
                                       client_timeout_s=client_timeout(request.headers.get(REQUEST_TIMEOUT_HEADER)),
                                       record=record, principal=principal)
        # The lane that started the answer (a decode handoff's continuation says so in x-llm-lanes-degraded).
        headers = answer.headers()
        if self.router_replica_id is not None:
            headers[ROUTER_REPLICA_HEADER] = self.router_replica_id
        if answer.events is not None:
            return StreamingResponse(answer.events, media_type="text/event-stream", headers=headers)
        return JSONResponse(answer.response, headers=headers)

    async def admin_stats_route(self, request: Request) -> dict[str, Any]:
        self.authenticate_http(request, admin=True)
        return await self.admin_stats()

    async def admin_prefix_lookup(self, request: Request) -> dict[str, Any]:
        """Which replicas hold how much of this prompt's prefix: {"prompt": str | [token ids]} -> matches."""
        self.authenticate_http(request, admin=True)
        try:
            body = await request.json()
        except ValueError:
            raise api.OpenAIError(400, "body is not JSON", code="invalid_json") from None
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), (str, list)):
            raise api.OpenAIError(400, "send {\"prompt\": <text or token ids>}", param="prompt")
        prompt = body["prompt"]
        token_ids = (self.pipeline.surface.tokenizer.encode(prompt, add_special_tokens=False)
                     if isinstance(prompt, str) else prompt)
        block_size = self.pipeline.cfg.hot_lane.engine.block_size
        matches = await self.prefix_cache.lookup.remote(block_hashes(token_ids, block_size), block_size)
        return {"prompt_tokens": len(token_ids), "block_size": block_size,
                "matches": [{"replica_id": replica, "matched_tokens": tokens} for replica, tokens in matches]}


HTTP_ROUTES = {
    "health": lambda app: app.get("/health"),
    "models": lambda app: app.get("/v1/models"),
    "model": lambda app: app.get("/v1/models/{model_id:path}"),
    "version": lambda app: app.get("/version"),
    "tokenize": lambda app: app.post("/tokenize"),
    "detokenize": lambda app: app.post("/detokenize"),
    "chat_completions": lambda app: app.post(CHAT.path),
    "completions": lambda app: app.post(COMPLETION.path),
    "admin_stats_route": lambda app: app.get("/v1/admin/stats"),
    "admin_prefix_lookup": lambda app: app.post("/v1/admin/prefix_lookup"),
}

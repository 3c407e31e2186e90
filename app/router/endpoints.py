"""The two generation endpoints (chat and completions): what differs between them, said once.

Every surface (HTTP, gRPC, batch lines) and the pipeline ask the endpoint instead of branching on its kind: its
request model, id prefix, the parameter that holds the prompt, and how an answer, a chunk and a usage-only chunk
look. Pure: no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from app.router import openai_api as api


@dataclass(frozen=True)
class Endpoint:
    name: str  # the `kind` label of traces and logs
    path: str
    body_model: type[BaseModel]
    id_prefix: str
    prompt_param: str
    chat: bool

    def new_id(self) -> str:
        return api.new_id(self.id_prefix)

    def response(self, request_id: str, model: str, text: str, finish_reason: str | None, usage: dict) -> dict:
        build = api.chat_response if self.chat else api.completion_response
        return build(request_id, model, text, finish_reason, usage)

    def chunk(self, request_id: str, model: str, text: str, finish_reason: str | None = None,
              usage: dict | None = None, first: bool = False) -> dict:
        """One streamed piece of the answer; a chat stream names the assistant role in its first chunk."""
        if not self.chat:
            return api.completion_chunk(request_id, model, text, finish_reason, usage)
        delta: dict[str, Any] = {"content": text} if text or first else {}
        if first:
            delta["role"] = "assistant"
        return api.chat_chunk(request_id, model, delta, finish_reason, usage)

    def usage_chunk(self, request_id: str, model: str, usage: dict) -> dict:
        """The usage-only chunk at the end of a stream (stream_options.include_usage): no choices."""
        if self.chat:
            return api.chat_chunk(request_id, model, {}, None, usage, with_choice=False)
        return api.completion_chunk(request_id, model, "", None, usage, with_choice=False)

    def validate(self, body: dict[str, Any]) -> BaseModel:
        """A JSON body -> the request model (pydantic's ValidationError on bad input)."""
        return self.body_model.model_validate(body)


CHAT = Endpoint("chat", "/v1/chat/completions", api.ChatCompletionRequest, "chatcmpl", "messages", chat=True)
COMPLETION = Endpoint("completion", "/v1/completions", api.CompletionRequest, "cmpl", "prompt", chat=False)
ENDPOINTS_BY_PATH = {endpoint.path: endpoint for endpoint in (CHAT, COMPLETION)}

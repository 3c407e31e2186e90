"""The two generation endpoints (chat and completions) and what travels between the OpenAI surface and the pipeline.

Every surface (HTTP, gRPC, batch lines) and the pipeline ask the endpoint instead of branching on its kind: its
path, the parameter that holds the prompt, its trace label. Requests and answers themselves are vLLM's own
(app/router/openai_surface.py); `Generation` and `Answer` are how they reach the pipeline and come back. Pure: no Ray,
no vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from app.lanes.types import AdapterRef


@dataclass(frozen=True)
class Endpoint:
    name: str  # the `kind` label of traces and logs
    path: str
    prompt_param: str
    chat: bool


CHAT = Endpoint("chat", "/v1/chat/completions", "messages", chat=True)
COMPLETION = Endpoint("completion", "/v1/completions", "prompt", chat=False)
ENDPOINTS_BY_PATH = {endpoint.path: endpoint for endpoint in (CHAT, COMPLETION)}

@dataclass
class Generation:
    """One prompt of a request, as vLLM rendered it, for the pipeline: the prompt's token ids, vLLM's
    SamplingParams (opaque to the pipeline and the lanes' types), and what the pipeline decides with."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...] = ()
    stream: bool = False
    engine_params: Any = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # Why the decode handoff cannot carry this request (None: it can).
    handoff_blocker: str | None = None
    # The LoRA adapter the client named as its model (None: the base model).
    adapter: AdapterRef | None = None


@dataclass
class Answer:
    """What the surface made of a request: a JSON response or SSE events, and the lane calls that serve it."""

    calls: list[Any]
    response: dict[str, Any] | None = None
    events: AsyncIterator[str] | None = None

    def headers(self) -> dict[str, str]:
        return self.calls[0].headers() if self.calls else {}

"""What travels between the Router and a lane replica. Plain dataclasses: no vLLM, no Ray.

The OpenAI surface's requests also carry vLLM's own SamplingParams (`LaneRequest.engine_params`) and get vLLM's
RequestOutputs back (`LaneChunk.output`): both opaque here, made and read only by the two vLLM adapters
(app/router/openai_surface.py and app/lanes/engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.classes import RequestClass
from app.config import IDENTITY_ADAPTER_NAME


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class AdapterRef:
    """The LoRA adapter a request runs under: its served name, the id every engine knows it by (one per name across
    the app), and the folder its engine loads it from."""

    name: str
    id: int
    path: str


# The identity adapter a CPU host's engine runs the base model's requests under (app/lanes/identity_adapter.py
# says why). Named here, beside AdapterRef, so that what reads the engine's KV events can tell the
# base model's blocks from an adapter's without importing the engine adapter.
BASE_ADAPTER_NAME = IDENTITY_ADAPTER_NAME
BASE_ADAPTER_ID = 2**31 - 1


@dataclass(frozen=True)
class LaneRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    request_class: RequestClass
    priority: int
    # False: the caller wants only the final answer, so the engine sends one chunk (no per-token objects).
    stream: bool = True
    # The client's own deadline (X-Request-Timeout header), if shorter than its class's.
    client_timeout_s: float | None = None
    # A hot replica without KV headroom may hand this request back for the cold lane instead of holding it.
    may_spill: bool = False
    # W3C trace context of the caller, so the lane's spans join the request's trace.
    trace_carrier: dict[str, str] = field(default_factory=dict)
    # True: each chunk carries the ids of the tokens it adds, so the Router can hand the answer to another lane.
    return_token_ids: bool = False
    # vLLM's SamplingParams for this request (the OpenAI surface's conversion of the client's body); its max_tokens
    # is replaced by `sampling.max_tokens`, which routing decisions may clip. None: `sampling` says it all.
    engine_params: Any = None
    # Further keyword arguments of the engine's generate() (a reasoning parser's state).
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # The LoRA adapter the client named as its model (None: the base model).
    adapter: AdapterRef | None = None


class LaneSaturated(Exception):
    """Raised by a hot replica before starting a request it may not admit (KV headroom kept for realtime)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class LaneReplicaLost(Exception):
    """The lane replica serving a call is gone (killed, crashed, its node lost): raised at the Router by the lane
    clients in place of Ray's actor errors, so the request path can tell a lost replica from other failures."""


class LaneRequestInvalid(Exception):
    """Raised by a lane when its engine refuses the request itself (a sampling value or prompt it cannot take),
    before any token: the client's error (400 naming `param`), not the lane's, so no breaker counts it.

    It crosses Ray from the replica to the Router, so it pickles by its own arguments; Ray's wrapper reads
    `message` and `param` through to it (str() of the wrapper is Ray's traceback)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self):
        return (LaneRequestInvalid, (self.message, self.param))


@dataclass
class LaneChunk:
    """One streamed piece of a generation. Token counts are cumulative so the last chunk carries the usage."""

    text: str
    completion_tokens: int
    prompt_tokens: int
    cached_prompt_tokens: int = 0
    finish_reason: str | None = None
    replica_id: str = ""
    lane: str = ""
    # The ids of the tokens this chunk adds (only when the request asked for them: LaneRequest.return_token_ids).
    token_ids: tuple[int, ...] = ()
    # The engine's own RequestOutput (without its prompt), for requests that carry engine_params.
    output: Any = None


@dataclass
class EngineStats:
    """A fresh snapshot of one engine: the tuning guide's `get_engine_stats()['scheduler']['running']` and more."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_capacity_tokens: int | None = None
    # Speculative decoding (engine.speculative_config), since the engine started: tokens drafted, and accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """The share of drafted tokens the target model accepted (None: nothing drafted)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

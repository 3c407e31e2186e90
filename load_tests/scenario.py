"""Scenario files: a list of request streams, each with its class, arrival process, prompt sizes and request shape.

Example (see load_tests/scenarios/ for complete files):

    name: mixed
    model: tiny-llama
    duration_s: 60                 # default for streams that give neither count nor duration_s
    slo: {interactive: {ttft_ms: 2000}, realtime: {ttft_ms: 1000}}
    tally_headers: [x-llm-lanes-lane, x-llm-lanes-degraded]
    streams:
      - name: chat
        request_class: interactive   # realtime | interactive | batch -> service_tier priority | default | flex
        arrival: {type: poisson, rate: 1.5}      # or {type: burst, n: 20, at_s: 5} or {type: closed, concurrency: 8}
        prompt_tokens: {dist: uniform, min: 48, max: 80}   # or a plain number
        max_tokens: 32
        stream: true
        endpoint: chat               # chat | completions
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

RequestClassName = Literal["realtime", "interactive", "batch"]
# How a client asks for each class (OpenAI's service_tier; see app/router/classes.py).
SERVICE_TIERS: dict[str, str] = {"realtime": "priority", "interactive": "default", "batch": "flex"}
CLASS_ORDER = ("realtime", "interactive", "batch")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LengthDist(_Strict):
    """A token count drawn per request: fixed `value`, uniform in [min, max], or normal(mean, std) clamped >= 1."""

    dist: Literal["fixed", "uniform", "normal"] = "fixed"
    value: int | None = Field(None, ge=1)
    min: int | None = Field(None, ge=1)
    max: int | None = Field(None, ge=1)
    mean: float | None = Field(None, gt=0)
    std: float | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _from_number(cls, data: Any) -> Any:
        return {"dist": "fixed", "value": data} if isinstance(data, int) else data

    @model_validator(mode="after")
    def _check(self) -> "LengthDist":
        needed = {"fixed": ("value",), "uniform": ("min", "max"), "normal": ("mean", "std")}[self.dist]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"dist {self.dist!r} needs {missing}")
        if self.dist == "uniform" and self.min > self.max:
            raise ValueError(f"uniform min={self.min} > max={self.max}")
        return self

    def sample(self, rng: random.Random) -> int:
        if self.dist == "fixed":
            return self.value
        if self.dist == "uniform":
            return rng.randint(self.min, self.max)
        return max(1, round(rng.gauss(self.mean, self.std)))

    @property
    def mean_tokens(self) -> float:
        if self.dist == "fixed":
            return float(self.value)
        if self.dist == "uniform":
            return (self.min + self.max) / 2
        return float(self.mean)


class PoissonArrival(_Strict):
    type: Literal["poisson"]
    rate: float = Field(gt=0, description="requests per second")


class BurstArrival(_Strict):
    type: Literal["burst"]
    n: int = Field(ge=1)
    at_s: float = Field(0.0, ge=0)


class ClosedLoopArrival(_Strict):
    type: Literal["closed"]
    concurrency: int = Field(ge=1)


Arrival = Annotated[PoissonArrival | BurstArrival | ClosedLoopArrival, Field(discriminator="type")]


class SharedPrefix(_Strict):
    """`groups` prefixes, each `prefix_tokens` long (drawn once per group); every request picks a group at random and
    appends its own unique suffix of `prompt_tokens` tokens."""

    groups: int = Field(ge=1)
    prefix_tokens: LengthDist


class StreamSpec(_Strict):
    name: str
    request_class: RequestClassName = "interactive"
    arrival: Arrival
    count: int | None = Field(None, ge=1, description="stop after this many requests")
    duration_s: float | None = Field(None, gt=0, description="stop issuing new requests after this long")
    start_s: float = Field(0.0, ge=0, description="delay before the stream's first request")
    prompt_tokens: LengthDist
    shared_prefix: SharedPrefix | None = None
    max_tokens: int = Field(ge=1)
    stream: bool = True
    endpoint: Literal["chat", "completions"] = "chat"
    model: str | None = None
    ignore_eos: bool | None = None
    # Anything else for the request body (temperature, vLLM extras): merged last.
    extra_body: dict[str, Any] = Field(default_factory=dict)

    @property
    def service_tier(self) -> str:
        return SERVICE_TIERS[self.request_class]


class ClassSLO(_Strict):
    ttft_ms: float | None = Field(None, gt=0)
    e2e_ms: float | None = Field(None, gt=0)


class Scenario(_Strict):
    name: str
    model: str
    description: str = ""
    seed: int = 0
    duration_s: float | None = Field(None, gt=0)
    request_timeout_s: float = Field(600, gt=0)
    # Unmeasured requests sent one by one before the run, so engine warm-up does not land in the numbers.
    warmup_requests: int = Field(0, ge=0)
    # Count a streamed chunk that carries a choice but no text as a token arrival (TTFT, ITL). For models whose
    # tokens can decode to nothing: the Llama-8B-shaped dummy model (random weights over a tokenizer padded with
    # reserved special tokens) samples mostly such tokens, so "first chunk with text" would measure luck, not
    # latency. Off by default: a real model's first text chunk is the OpenAI-standard TTFT.
    count_empty_chunks: bool = False
    slo: dict[RequestClassName, ClassSLO] = Field(default_factory=dict)
    tally_headers: list[str] = Field(default_factory=list)
    streams: list[StreamSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> "Scenario":
        names = [s.name for s in self.streams]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"stream names must be unique: {duplicates}")
        for stream in self.streams:
            if stream.arrival.type == "burst":
                if stream.count is not None and stream.count != stream.arrival.n:
                    raise ValueError(f"stream {stream.name!r}: a burst sends arrival.n requests; drop count")
            elif stream.count is None and stream.duration_s is None and self.duration_s is None:
                raise ValueError(
                    f"stream {stream.name!r}: give count or duration_s (or a scenario-level duration_s)"
                )
        return self

    def stream_duration_s(self, stream: StreamSpec) -> float | None:
        if stream.count is not None:
            return stream.duration_s
        return stream.duration_s if stream.duration_s is not None else self.duration_s

    def model_for(self, stream: StreamSpec) -> str:
        return stream.model or self.model

    def expected_requests(self) -> int | None:
        """For the progress bar: exact for counted streams and bursts, an estimate for Poisson by duration, unknown
        (None) for closed loops that run by duration."""
        total = 0.0
        for stream in self.streams:
            if stream.arrival.type == "burst":
                total += stream.arrival.n
            elif stream.count is not None:
                total += stream.count
            elif stream.arrival.type == "poisson":
                total += stream.arrival.rate * self.stream_duration_s(stream)
            else:
                return None
        return round(total)


class ScenarioError(ValueError):
    pass


def parse_scenario(data: dict[str, Any]) -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as error:
        lines = []
        for item in error.errors():
            path = ".".join(str(p) for p in item["loc"]) or "(top level)"
            lines.append(f"{path}: {item['msg'].removeprefix('Value error, ')}")
        raise ScenarioError("invalid scenario:\n" + "\n".join(lines)) from None


def load_scenario(path: str | Path) -> Scenario:
    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario is a YAML mapping")
    return parse_scenario(data)

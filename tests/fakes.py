"""Fakes shared by the tests: a clock, and the fakes around the Router's real request path (lanes, metrics backend,
and the surfaces built through their constructors). No Ray cluster, no vLLM engine: the Router's OpenAI surface is
vLLM's real serving code on the tiny model's tokenizer, and a fake lane answers as the engine adapter does (a vLLM
RequestOutput in each chunk of a request that carries vLLM's SamplingParams)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import yaml

from app.batch.dispatcher import BatchDispatcher
from app.batch.open_store import open_batch_store
from app.classes import Lane
from app.config import load_app_config
from app.lanes.types import LaneChunk, LaneRequest
from app.observability import tracing as tr
from app.observability.metrics import LlmLanesMetrics
from app.router.batch_api import BatchApi, execute_batch_line
from app.router.control import TrafficControl
from app.router.deployment import admin_document
from app.router.auth import KeyRing
from app.router.grpc_api import GrpcApi
from app.router.http_api import HttpApi
from app.router.endpoints import Generation
from app.router.pipeline import RequestPipeline

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / "models" / "tiny-llama"


class FakeClock:
    """A clock the test moves: `clock()` reads it (as time.monotonic / time.time would), `advance(s)` moves it.
    With `tick`, every read first moves it by that much (each read sees a later time, e.g. for LRU order)."""

    def __init__(self, now: float = 1000.0, tick: float = 0.0):
        self.now = now
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def cpu_args(**extra):
    """App args for a two-lane CPU app (the schema's defaults elsewhere), with `extra` top-level blocks."""
    lane = {"engine": {"kv_cache_memory_bytes": 1 << 28, "dtype": "float32"}, "deployment": {}}
    return {"device": "cpu", "model": {"source": str(TINY_MODEL), "served_name": "tiny", "max_model_len": 2048,
                                       "tool_call_parser": "hermes", "enable_auto_tool_choice": True},
            "hot_lane": yaml.safe_load(yaml.safe_dump(lane)), "cold_lane": yaml.safe_load(yaml.safe_dump(lane)),
            "auth": {"mode": "none"}, **extra}


class FakeMetricsModule:
    """Stands in for ray.serve.metrics: records every observation as (metric name, value, tags)."""

    def __init__(self):
        self.samples: list[tuple[str, float, dict[str, str]]] = []
        recorder = self

        class _Metric:
            def __init__(self, name, description="", tag_keys=(), boundaries=None):
                self.name, self.tag_keys = name, tuple(tag_keys)

            def _record(self, value, tags):
                assert set(tags or {}) == set(self.tag_keys), (self.name, tags)
                assert all(isinstance(v, str) for v in (tags or {}).values())
                recorder.samples.append((self.name, value, dict(tags or {})))

            inc = observe = set = _record

        self.Counter = self.Gauge = self.Histogram = _Metric

    def of(self, name: str) -> list[tuple[float, dict[str, str]]]:
        return [(value, tags) for metric, value, tags in self.samples if metric == name]


def engine_output(request: LaneRequest, text: str, token_ids: list[int], finished: bool, finish_reason: str | None):
    """What the engine adapter puts in a chunk: vLLM's RequestOutput, without the prompt."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    logprobs = None
    if request.engine_params.logprobs is not None:  # each token its own only candidate, at -1.0
        logprobs = [{token_id: Logprob(logprob=-1.0, rank=1)} for token_id in token_ids]
    completion = CompletionOutput(index=0, text=text, token_ids=token_ids, cumulative_logprob=None, logprobs=logprobs,
                                  finish_reason=finish_reason if finished else None)
    return RequestOutput(request.request_id, prompt=None, prompt_token_ids=None, prompt_logprobs=None,
                         outputs=[completion], finished=finished, num_cached_tokens=0)


def generation(prompt_tokens: int = 5, max_tokens: int = 2, stream: bool = False, request_id: str = "cmpl-test",
               stop: tuple[str, ...] = (), handoff_blocker: str | None = None,
               prompt_token_ids: list[int] | None = None) -> Generation:
    """A prompt as the OpenAI surface hands it to the pipeline, without vLLM's SamplingParams."""
    if prompt_token_ids is None:
        prompt_token_ids = list(range(1, prompt_tokens + 1))
    return Generation(request_id=request_id, prompt_token_ids=prompt_token_ids,
                      max_tokens=max_tokens, stop=stop, stream=stream, handoff_blocker=handoff_blocker)


_SURFACES: dict[str, object] = {}


def openai_surface(cfg):
    """vLLM's serving code for the tiny model (built once per model settings: it loads the tokenizer)."""
    from app.router.openai_surface import OpenAISurface
    from app.tools.make_tiny_model import is_current, make_tiny_model

    if not is_current(TINY_MODEL):
        make_tiny_model(TINY_MODEL)
    key = cfg.model.model_dump_json() + str(cfg.router.default_max_tokens)
    if key not in _SURFACES:
        _SURFACES[key] = OpenAISurface(cfg)
    return _SURFACES[key]


class FakeStream:
    def __init__(self, chunks, delay_s: float = 0.0):
        self._chunks = iter(chunks)
        self.delay_s = delay_s
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(self.delay_s)
        try:
            return next(self._chunks)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self):
        self.cancelled = True


class FakeLane:
    """A lane: `remote(request)` streams three chunks of 2 tokens each (one chunk when not streamed)."""

    def __init__(self, name: str, delay_s: float = 0.0):
        self.name = name
        self.delay_s = delay_s
        self.requests: list[LaneRequest] = []

    def remote(self, request: LaneRequest) -> FakeStream:
        self.requests.append(request)
        return FakeStream(lane_chunks(request, self.name), self.delay_s)


def lane_chunks(request: LaneRequest, lane: str, texts: list[str] | None = None,
                finish_reason: str = "length") -> list[LaneChunk]:
    """Three chunks of 2 tokens each (one chunk when not streamed), as the engine adapter sends them."""
    prompt = len(request.prompt_token_ids)
    texts = texts or (["ab", "cd", "ef"] if request.stream else ["abcdef"])
    chunks, sent = [], 0
    for i, text in enumerate(texts):
        done = i == len(texts) - 1
        tokens = 6 if done else 2 * (i + 1)
        ids = list(range(10 + sent, 10 + tokens))
        sent = tokens
        output = (engine_output(request, text, ids, done, finish_reason)
                  if request.engine_params is not None else None)
        chunks.append(LaneChunk(text=text, completion_tokens=tokens, prompt_tokens=prompt,
                                finish_reason=finish_reason if done else None, lane=lane, output=output))
    return chunks


class FakeLanes:
    """The pipeline's LaneClients over FakeLane objects keyed by lane name ("hot", "cold")."""

    def __init__(self, lanes: dict[str, FakeLane]):
        self.by_name = lanes

    def open(self, lane: Lane, request: LaneRequest):
        return self.by_name[lane.value].remote(request)


class RouterSurfaces(HttpApi, BatchApi, GrpcApi):
    """The Router's three surfaces over a real pipeline, built through a constructor (what the deployment wires)."""

    def __init__(self, pipeline: RequestPipeline, lanes: dict[str, FakeLane], metrics_backend: FakeMetricsModule,
                 batch_store, dispatcher: BatchDispatcher | None = None):
        self.pipeline = pipeline
        self.cfg = pipeline.cfg
        self.control = pipeline.control
        self.tracing = pipeline.tracing
        self.metrics = pipeline.metrics
        self.lanes = lanes
        self.metrics_backend = metrics_backend
        self.batch_store = batch_store
        self.keyring = KeyRing.from_config(self.cfg.auth)
        # Never run: the surfaces only notify it of new work.
        self.dispatcher = dispatcher or BatchDispatcher(batch_store, lambda line: execute_batch_line(pipeline, line),
                                                        pipeline.cfg.batch)
        self.prefix_cache = None
        self.lane_replicas = {"hot": 1, "cold": 1}

        self.lane_handles: dict[Lane, object] = {}

    async def admin_stats(self):
        return await admin_document(self.lane_handles, self.prefix_cache, self.pipeline, self.dispatcher)


def make_pipeline(lanes: dict[str, FakeLane] | None = None, tracing_exporter: str | None = None,
                  clock: Callable[[], float] | None = None, **cfg_extra):
    """(pipeline, lanes, metrics backend) with fake lanes and the real TrafficControl."""
    cfg = load_app_config(cpu_args(**cfg_extra))
    lanes = lanes or {"hot": FakeLane("hot"), "cold": FakeLane("cold")}
    backend = FakeMetricsModule()
    control = TrafficControl(cfg, **({"clock": clock} if clock else {}))
    pipeline = RequestPipeline(cfg, openai_surface(cfg), control, FakeLanes(lanes),
                               LlmLanesMetrics(metrics_module=backend),
                               tr.setup_tracing({"exporter": tracing_exporter or "none"},
                                                component="Router"))
    return pipeline, lanes, backend


def make_router(tmp_path, tracing_exporter=None, lanes: dict[str, FakeLane] | None = None,
                **cfg_extra) -> RouterSurfaces:
    pipeline, lanes, backend = make_pipeline(lanes, tracing_exporter, **cfg_extra)
    return RouterSurfaces(pipeline, lanes, backend, open_batch_store(str(tmp_path / "batches.sqlite3")))

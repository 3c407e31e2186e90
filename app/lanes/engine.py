"""The vLLM adapter: the only module in llm-lanes that imports vllm.

It owns one `AsyncLLM` per lane replica and speaks in llm-lanes' own types (LaneRequest in, LaneChunk out,
EngineStats for the scheduler's state), through vLLM's public surface: AsyncEngineArgs, AsyncLLM, SamplingParams,
TokensPrompt and a stat logger (the hook vLLM offers for reading scheduler stats every engine step).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from app.config import AppConfig, EngineSettings
from app.lanes.cpu_priority import parse_cpu_list, pin_process, renice_process_tree
from app.lanes.identity_adapter import identity_adapter
from app.lanes.types import (BASE_ADAPTER_ID, BASE_ADAPTER_NAME, AdapterRef, EngineStats, LaneChunk, LaneReplicaLost,
                             LaneRequest, LaneRequestInvalid)

logger = logging.getLogger(__name__)


def configure_vllm_logging() -> None:
    """Let vLLM set up its logging now. vLLM does it with logging.config.dictConfig, when `vllm.logger` is first
    imported and again when an engine's config is made with another logging config than the last applied, and
    dictConfig closes every logging handler that exists at that moment. Done at a replica's engine start, it closed
    the handlers Ray Serve had given the replica's logger: the replica's log file got nothing more, and the closed
    MemoryHandler, still attached, kept every later record in its buffer (about 1.5 KiB per request, without end: a
    2-hour soak's ColdLane replica held 93,000 of them). Called while Ray Serve imports the lane's deployment class,
    before it sets up the replica's logging, with the config the engine's start applies (the engine arguments set no
    logging options), so that start finds it applied."""
    import vllm.logger

    if hasattr(vllm.logger, "configure_logging_if_needed"):  # vLLM 0.32; 0.26 configures only on import
        from vllm.config import LoggingConfig

        vllm.logger.configure_logging_if_needed(LoggingConfig())


def engine_args_dict(cfg: AppConfig, settings: EngineSettings,
                     kv_events_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Our schema -> vLLM engine arguments. Pure, so the mapping is unit-tested without vLLM."""
    args: dict[str, Any] = dict(
        model=cfg.model.source,
        tokenizer=cfg.model.tokenizer_source,
        served_model_name=cfg.model.served_name,
        max_model_len=cfg.model.max_model_len,
        tensor_parallel_size=settings.tensor_parallel_size,
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_prefix_caching=settings.enable_prefix_caching,
        scheduling_policy=settings.scheduling_policy,
        dtype=settings.dtype,
        enforce_eager=settings.enforce_eager,
        stream_interval=settings.stream_interval,
        # The stat logger below needs stats on.
        disable_log_stats=False,
    )
    if cfg.device == "gpu":
        args["gpu_memory_utilization"] = settings.gpu_memory_utilization
    if settings.kv_cache_memory_bytes is not None:
        args["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
    if settings.lora is not None:
        args.update(enable_lora=True, max_loras=settings.lora.max_loras, max_lora_rank=settings.lora.max_lora_rank,
                    max_cpu_loras=settings.lora.max_cpu_loras)
    if settings.speculative_config:
        args["speculative_config"] = dict(settings.speculative_config)
    if kv_events_config:
        # The replica's own KV-event endpoint (app.prefix_cache.replica_feed): the exact prefix-index feed.
        args["kv_events_config"] = kv_events_config
    if cfg.model.load_format:
        args["load_format"] = cfg.model.load_format
    if settings.tensor_parallel_size > 1:
        # Inside a Serve replica the TP workers must be Ray actors in the replica's placement group; a
        # multiprocessing executor would only see the one GPU Ray gave the replica actor.
        args["distributed_executor_backend"] = "ray"
    args.update(settings.extra_engine_args)
    if settings.cuda_graph_max_tokens is not None and cfg.device == "gpu":
        args["compilation_config"] = {**(args.get("compilation_config") or {}),
                                      "max_cudagraph_capture_size": settings.cuda_graph_max_tokens}
    return args


def check_adapter(name: str, path: str, max_lora_rank: int | None, max_model_len: int) -> None:
    """Raise ValueError, naming the adapter and why, if the LoRA adapter in folder `path` cannot be served: no LoRA
    on the lanes (`max_lora_rank` None), no PEFT adapter there, or a rank above max_lora_rank. Reads the folder as
    vLLM's loader does (PEFTHelper), without an engine."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    if max_lora_rank is None:
        raise ValueError(f"LoRA adapter {name!r}: this app serves no LoRA adapters (set engine.lora on every lane)")
    try:
        helper = PEFTHelper.from_local_dir(path, max_model_len)
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {path!r}") from None
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"LoRA adapter {name!r}: {path!r} is not a PEFT LoRA adapter ({error})") from None
    try:
        helper.validate_legal(LoRAConfig(max_lora_rank=max_lora_rank))
    except ValueError as error:
        raise ValueError(f"LoRA adapter {name!r}: {error}") from None


def _lora_request(adapter: AdapterRef):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.name, lora_int_id=adapter.id, lora_path=adapter.path)


# What vLLM raises for a request it will not take, besides its own client errors: its checks' ValueError and
# TypeError, and its transport's refusal of a value (OverflowError for an integer past 64 bits, UnicodeEncodeError, a
# ValueError, for a string that is not UTF-8).
_REQUEST_VALUE_ERRORS = (ValueError, TypeError, OverflowError)


def request_invalid(error: BaseException) -> LaneRequestInvalid | None:
    """vLLM's refusal of a request, raised while the request is built or added (before any token), as the client's
    error; None for anything else, which is the engine's failure."""
    from vllm.v1.engine.exceptions import EngineGenerateError

    if isinstance(error, EngineGenerateError) and error.__cause__ is not None:
        # AsyncLLM wraps an error it did not expect while adding the request (its transport's, say): judge the cause.
        error = error.__cause__
    if isinstance(error, _client_error_types()):
        return LaneRequestInvalid(_printable(error.args[0] if error.args else error),
                                  getattr(error, "parameter", None))
    if isinstance(error, _REQUEST_VALUE_ERRORS):
        return LaneRequestInvalid(_printable(error))
    return None


def _client_error_types() -> tuple[type[BaseException], ...]:
    """vLLM's errors for a request it refuses (their `parameter` names the field). 0.32 has one base class for them;
    0.26 has no base class, and its VLLMValidationError is a ValueError."""
    import vllm.exceptions as errors

    if hasattr(errors, "VLLMClientError"):
        return (errors.VLLMClientError,)
    return tuple(getattr(errors, name) for name in ("VLLMValidationError", "VLLMNotFoundError",
                                                     "VLLMUnprocessableEntityError") if hasattr(errors, name))


def _printable(message: object) -> str:
    # The message goes back to the client as JSON: a lone surrogate in it would fail the response's encoding.
    return str(message).encode("utf-8", "backslashreplace").decode("utf-8")


@contextmanager
def placed_on_cpus(cfg: AppConfig, settings: EngineSettings) -> Iterator[None]:
    """Start an engine inside this block to put it where the lane's settings say (CPU hosts only):
    - its worker threads on `cpu_threads_bind`: vLLM's CPU worker reads VLLM_CPU_OMP_THREADS_BIND when it starts, and
      two engines left on the default share core 0;
    - its engine-core process (the scheduler) on `cpu_engine_core_bind`, else with the frontend: the process spawns
      with this process's affinity, so this process is pinned there while inside the block;
    - this (replica) process, vLLM's frontend, on `cpu_frontend_bind` from then on (app/lanes/cpu_priority.py says
      why); with only an engine-core binding it gets its own affinity back on leaving."""
    if cfg.device != "cpu":
        yield
        return
    if settings.cpu_threads_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = settings.cpu_threads_bind
    own_affinity = os.sched_getaffinity(0)
    engine_core_cpus = settings.cpu_engine_core_bind or settings.cpu_frontend_bind
    if engine_core_cpus:
        _pin_self(engine_core_cpus, "cpu_engine_core_bind" if settings.cpu_engine_core_bind else "cpu_frontend_bind")
    try:
        yield
    finally:
        if settings.cpu_engine_core_bind:
            if settings.cpu_frontend_bind:
                _pin_self(settings.cpu_frontend_bind, "cpu_frontend_bind")
            else:
                pin_process(os.getpid(), own_affinity)
    logger.info("engine placement: worker threads on %s, engine core on %s, frontend on %s",
                settings.cpu_threads_bind or "vLLM's default", engine_core_cpus or "any CPU",
                settings.cpu_frontend_bind or "any CPU")


def _pin_self(cpu_list: str, setting: str) -> None:
    """Pin every thread of this process to `cpu_list` (the value of `setting`), naming the setting if the host
    cannot take it."""
    try:
        pin_process(os.getpid(), parse_cpu_list(cpu_list))
    except OSError as error:  # EINVAL: none of those cores exists (or is allowed) on this host
        raise RuntimeError(f"{setting}={cpu_list!r} cannot be applied on this host "
                           f"({os.cpu_count()} CPUs, allowed {sorted(os.sched_getaffinity(0))}): {error}") from error


class VllmEngine:
    """One vLLM AsyncLLM, started by `start()`, stopped by `shutdown()`."""

    def __init__(self, cfg: AppConfig, settings: EngineSettings, lane: str, replica_id: str,
                 kv_events_config: dict[str, Any] | None = None):
        self.cfg = cfg
        self.kv_events_config = kv_events_config
        self.settings = settings
        self.lane = lane
        self.replica_id = replica_id
        self._engine = None
        self._latest_scheduler_stats = None
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._spec_draft_tokens = 0
        self._spec_accepted_tokens = 0
        # LoRA adapter id -> name, of every served adapter this engine has loaded (the engine reports ids only), and
        # the ids loaded (checked by the engine) so far, the identity adapter's included.
        self._adapter_names: dict[int, str] = {}
        self._loaded_adapter_ids: set[int] = set()
        # On a CPU host the base model's requests run under an identity adapter (identity_adapter says why).
        self._base_adapter: AdapterRef | None = None

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args_dict(self.cfg, self.settings, self.kv_events_config)
        if "kv_events_config" in args:
            from vllm.config import KVEventsConfig

            args["kv_events_config"] = KVEventsConfig(**args["kv_events_config"])
        engine_args = AsyncEngineArgs(**args)
        with placed_on_cpus(self.cfg, self.settings):
            self._engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=self.stat_logger_factories())
        if self.settings.lora is not None:
            await self._load_configured_adapters()
        if self.settings.cpu_nice:
            # The engine-core process and its worker threads exist now; this replica's own threads stay at the
            # default priority (they stream results back to the Router).
            changed = renice_process_tree(os.getpid(), self.settings.cpu_nice)
            logger.info("%s lane engine: %d threads reniced to %d", self.lane, changed, self.settings.cpu_nice)

    def stat_logger_factories(self) -> list:
        """Our per-engine LatestSchedulerStats, plus vLLM's RayPrometheusStatLogger (ray_vllm_* on Ray's metrics
        port) when observability.vllm_metrics is on.

        vLLM 0.32's StatLoggerManager takes both kinds in one list: a class that subclasses AggregateStatLoggerBase
        (RayPrometheusStatLogger, via PrometheusStatLogger) is built once for all engine indexes, anything else is
        called per engine as factory(vllm_config, engine_index) (our class). Passing a PrometheusStatLogger subclass
        also stops vLLM from adding its default prometheus_client logger. Custom loggers force stats on in AsyncLLM
        even with disable_log_stats, so neither logger is silently dropped.
        """
        factories: list = [self._stat_logger_factory()]
        if self.cfg.observability.vllm_metrics:
            from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

            factories.append(RayPrometheusStatLogger)
        return factories

    def _stat_logger_factory(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class LatestSchedulerStats(StatLoggerBase):
            """Keeps the scheduler's state of the latest engine step: fresh numbers without scraping."""

            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is None:
                    return
                engine._latest_scheduler_stats = scheduler_stats
                prefix = scheduler_stats.prefix_cache_stats
                if prefix.reset:
                    engine._prefix_queries = engine._prefix_hits = 0
                engine._prefix_queries += prefix.queries
                engine._prefix_hits += prefix.hits
                spec = scheduler_stats.spec_decoding_stats
                if spec is not None:
                    engine._spec_draft_tokens += spec.num_draft_tokens
                    engine._spec_accepted_tokens += spec.num_accepted_tokens

            def log_engine_initialized(self):
                pass

        return LatestSchedulerStats

    @property
    def tokenizer(self):
        return self._engine.get_tokenizer()

    async def generate(self, request: LaneRequest) -> AsyncIterator[LaneChunk]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        options = request.sampling
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        completion_tokens = 0
        base = LaneChunk(text="", completion_tokens=0, prompt_tokens=len(request.prompt_token_ids),
                         replica_id=self.replica_id, lane=self.lane)
        produced = False
        try:
            if request.engine_params is not None:
                # The OpenAI surface's conversion of the client's body; routing may have clipped max_tokens.
                params = request.engine_params.clone()
                params.max_tokens = options.max_tokens
            else:
                params = SamplingParams(
                    max_tokens=options.max_tokens,
                    temperature=options.temperature,
                    top_p=options.top_p,
                    stop=list(options.stop) or None,
                    seed=options.seed,
                    ignore_eos=options.ignore_eos,
                    output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
                )
            with_output = request.engine_params is not None
            engine_kwargs = dict(request.engine_kwargs)
            adapter = request.adapter or self._base_adapter
            if adapter is not None:
                engine_kwargs["lora_request"] = await self._lora_request(adapter)
            # AsyncLLM aborts the engine request itself when this generator is cancelled or closed (client gone).
            async for output in self._engine.generate(prompt, params, request.request_id, priority=request.priority,
                                                      **engine_kwargs):
                produced = True
                token_ids = [t for completion in output.outputs for t in completion.token_ids]
                completion_tokens += len(token_ids)
                finish_reason = None
                if output.finished:
                    finish_reason = next((c.finish_reason for c in output.outputs if c.finish_reason), "stop")
                if with_output:
                    # The Router knows the prompt: no copy of it in every chunk across Ray.
                    output.prompt_token_ids = None
                    output.metrics = None
                yield replace(
                    base,
                    text="".join(completion.text for completion in output.outputs),
                    completion_tokens=completion_tokens,
                    cached_prompt_tokens=output.num_cached_tokens or 0,
                    token_ids=tuple(token_ids) if request.return_token_ids else (),
                    finish_reason=finish_reason,
                    output=output if with_output else None,
                )
        except Exception as error:
            from vllm.v1.engine.exceptions import EngineDeadError

            if isinstance(error, EngineDeadError):
                # The engine's processes are gone (killed with the replica, or crashed): the request is lost with
                # them, as with a lost replica, and the Router goes on elsewhere from the tokens it has.
                raise LaneReplicaLost(f"the {self.lane} lane's engine died: {error}") from error
            # Only a refusal before the first output is the request's fault; anything later is the engine's.
            invalid = None if produced else request_invalid(error)
            if invalid is None:
                raise
            raise invalid from error

    async def _lora_request(self, adapter: AdapterRef):
        if self.settings.lora is None:
            # The schema puts LoRA on every lane that serves adapters; an engine without it would answer with the
            # base model's weights under the adapter's name.
            raise LaneRequestInvalid(f"the {self.lane} lane serves no LoRA adapters (model {adapter.name!r})",
                                     "model")
        if adapter.id not in self._loaded_adapter_ids:
            try:
                await self.load_adapter(adapter)
            except ValueError as error:
                raise LaneRequestInvalid(str(error), "model") from None
        return _lora_request(adapter)

    async def load_adapter(self, adapter: AdapterRef) -> None:
        """Load `adapter` into the engine (or mark it used, if held), which checks it against the model: its files,
        its rank, its shapes. Raises ValueError naming the adapter and why, and the engine goes on. A request naming
        an adapter the engine has not loaded would load it inside an engine step, where a refusal kills the engine
        with every request in it; so every adapter is loaded here first."""
        try:
            await self._engine.add_lora(_lora_request(adapter))
        except Exception as error:
            # A refused adapter can stay in the engine's host-memory cache, where a step would activate it again.
            with contextlib.suppress(Exception):
                await self._engine.remove_lora(adapter.id)
            message = str(error)
            # vLLM wraps the worker's refusal: "Call to add_lora method failed: Worker failed with error '...'".
            if "with error '" in message:
                message = message.split("with error '", 1)[1].rsplit("'", 1)[0]
            raise ValueError(f"LoRA adapter {adapter.name!r} ({adapter.path}) cannot be loaded on the {self.lane} "
                             f"lane: {message}") from None
        self._loaded_adapter_ids.add(adapter.id)
        if adapter.id != BASE_ADAPTER_ID:
            self._adapter_names[adapter.id] = adapter.name

    async def _load_configured_adapters(self) -> None:
        """model.adapters, with the ids the Router gives them (their order, from 1), and on a CPU host the identity
        adapter the base model's requests run under."""
        if self.cfg.device == "cpu":
            identity = AdapterRef(BASE_ADAPTER_NAME, BASE_ADAPTER_ID, identity_adapter(self.cfg.model.source))
            await self.load_adapter(identity)
            self._base_adapter = identity
        for adapter_id, adapter in enumerate(self.cfg.model.adapters, start=1):
            await self.load_adapter(AdapterRef(adapter.name, adapter_id, adapter.path))

    async def held_adapters(self) -> frozenset[str]:
        """The LoRA adapters this engine holds now (loaded in its host-memory cache), by name."""
        if self._engine is None or self.settings.lora is None:
            return frozenset()
        ids = await self._engine.list_loras()
        return frozenset(self._adapter_names[i] for i in ids if i in self._adapter_names)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def check_health(self) -> None:
        await self._engine.check_health()

    def stats(self) -> EngineStats:
        latest = self._latest_scheduler_stats
        cache = self._engine.vllm_config.cache_config if self._engine else None
        capacity = cache.num_gpu_blocks * cache.block_size if cache and cache.num_gpu_blocks else None
        return EngineStats(
            running=latest.num_running_reqs if latest else 0,
            # vLLM counts requests held back by a transient limit (e.g. max_num_seqs reached) apart from the rest;
            # both are waiting as far as an operator or the admission policy is concerned.
            waiting=(latest.num_waiting_reqs + latest.num_skipped_waiting_reqs) if latest else 0,
            kv_cache_usage=latest.kv_cache_usage if latest else 0.0,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            kv_capacity_tokens=capacity,
            spec_draft_tokens=self._spec_draft_tokens,
            spec_accepted_tokens=self._spec_accepted_tokens,
        )

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def offline_generate(cfg: AppConfig, settings: EngineSettings, prompts: list[list[int]], max_tokens: int, *,
                     temperature: float = 0.0, warmup_prompts: list[list[int]] | None = None,
                     warmup_max_tokens: int = 8) -> dict[str, Any]:
    """The bare-engine baseline: vLLM's offline `LLM` on one lane's engine settings, every prompt (token ids) handed
    over at once, `max_tokens` tokens each (ignore_eos). Used by load_tests/batch_throughput.py; run it in a process
    of its own (the engine's threads and memory go with the process).

    Only the measured generate() is timed, not the engine's start or the warm-up (`warmup_prompts`, a few short
    generations first so one-off set-up costs are not counted). Returns requests, prompt_tokens, output_tokens,
    generate_s and engine_start_s.
    """
    import time

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    # The lane's own engine arguments, unchanged (LLM passes them to EngineArgs); stream_interval has no effect here,
    # as LLM.generate returns whole outputs. Placed as a lane replica places its engine: the same settings, the same
    # cores.
    with placed_on_cpus(cfg, settings):
        llm = LLM(**engine_args_dict(cfg, settings))
    engine_start_s = time.perf_counter() - started
    try:
        if warmup_prompts:
            llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in warmup_prompts],
                         SamplingParams(max_tokens=warmup_max_tokens, ignore_eos=True, temperature=temperature),
                         use_tqdm=False)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature)
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        began = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        generate_s = time.perf_counter() - began
    finally:
        # LLM has no public shutdown; its engine-core client stops the engine-core process.
        llm.llm_engine.engine_core.shutdown()
    return {
        "requests": len(outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids or ()) for o in outputs),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "generate_s": generate_s,
        "engine_start_s": engine_start_s,
    }

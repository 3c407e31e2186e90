"""hot_lane / cold_lane: each lane's vLLM engine arguments and its Serve deployment (replicas, autoscaling)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from app.config.base import ALLOWED_BLOCK_SIZES, MAX_HEALTH_CHECK_PERIOD_S, StrictModel, parse_cpu_list


# vLLM's choices for max_lora_rank (its LoRAConfig refuses any other).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraSettings(StrictModel):
    """vLLM's multi-LoRA in a lane's engines (its enable_lora, with these limits). Set on every lane when the app
    serves adapters (model.adapters, or any loaded at run time)."""

    # Adapters one engine step can mix: each takes a slot of max_lora_rank in device memory for the engine's life.
    max_loras: int = Field(1, ge=1)
    # The largest rank an adapter may have (a larger one is refused when loaded); the slots are sized by it.
    max_lora_rank: int = 16
    # Adapters an engine keeps in host memory, read from disk once; the least recently used goes first. None: as
    # many as max_loras.
    max_cpu_loras: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "LoraSettings":
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} is not one vLLM supports: use one of "
                             f"{list(LORA_RANKS)} at least as large as your adapters' rank")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} < max_loras={self.max_loras}: every adapter in a "
                             "step is also in host memory; raise max_cpu_loras or leave it unset")
        return self


class EngineSettings(StrictModel):
    """The vLLM engine arguments llm-lanes supports, per lane. `extra_engine_args` passes anything else through."""

    tensor_parallel_size: int = Field(1, ge=1)
    block_size: int = 32
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    dtype: str = "auto"
    enforce_eager: bool = False
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    speculative_config: dict[str, Any] | None = None
    # Tokens per streamed chunk after the first (which is never held back). Every chunk is one Ray object on its way
    # through the Router, so 1 can make the Router, not the engine, the bottleneck of fast small models.
    stream_interval: int = Field(1, ge=1)
    # vLLM-CPU pins an engine's worker threads (VLLM_CPU_OMP_THREADS_BIND); two engines on one host need
    # disjoint bindings or they share one core. Ignored on GPU.
    cpu_threads_bind: str | None = None
    # OS niceness (0-19) of the engine's processes. Ray starts its workers at 15; on a CPU host a batch engine at
    # 16-19 still gets every idle cycle but yields the cores to the HTTP proxy, the Router and the hot lane when they
    # need one (app/lanes/cpu_priority.py; measured in docs/benchmarks.md). 0 leaves them as Ray started them.
    cpu_nice: int = Field(0, ge=0, le=19)
    # Cores for the lane replica's own process and the engine-core process it starts (vLLM's frontend and scheduler),
    # e.g. "0": on a CPU host, keeps them off the worker's cpu_threads_bind cores, which they otherwise share at
    # random (app/lanes/cpu_priority.py). None leaves them to the OS. Ignored on GPU.
    cpu_frontend_bind: str | None = None
    # Cores for the engine-core process alone, e.g. the worker's own core: the scheduler and the worker take turns
    # (each waits for the other every step), so they share a core at little cost, and the frontend, the Router and
    # the other lane on the remaining cores no longer delay every step. None: the engine core goes with the frontend.
    cpu_engine_core_bind: str | None = None
    # Largest step (in tokens) that vLLM runs as a CUDA graph. vLLM's default is 2 x max_num_seqs (capped at 512),
    # made for decode batches: a hot lane with max_num_seqs 32 ran every 112-288-token prefill without graphs,
    # ~hundreds of kernel launches each. 512 took realtime TTFT p50 from ~42 to ~30 ms on the H200 (round 9,
    # docs/benchmarks-gpu.md). Each captured size costs start-up time and a little GPU memory. GPU only.
    cuda_graph_max_tokens: int | None = Field(None, ge=1, le=8192)
    # Multi-LoRA (None: off, and a request for an adapter cannot run on this lane).
    lora: LoraSettings | None = None
    extra_engine_args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "EngineSettings":
        if self.block_size not in ALLOWED_BLOCK_SIZES:
            raise ValueError(
                f"block_size={self.block_size} is not supported: use a power of two in {list(ALLOWED_BLOCK_SIZES)}"
            )
        if not 0 < self.gpu_memory_utilization <= 0.95:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} is out of range: "
                "use a fraction in (0, 0.95]; above 0.95 leaves no room for activations and CUDA graphs"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs={self.max_num_seqs}: "
                "raise max_num_batched_tokens to at least max_num_seqs (every running sequence needs a token per step)"
            )
        for setting in ("cpu_frontend_bind", "cpu_engine_core_bind"):
            if getattr(self, setting) is not None:
                try:
                    parse_cpu_list(getattr(self, setting))
                except ValueError as error:
                    raise ValueError(f"{setting}: {error}") from None
        if self.cuda_graph_max_tokens is not None and "max_cudagraph_capture_size" in (
                self.extra_engine_args.get("compilation_config") or {}):
            raise ValueError(
                "cuda_graph_max_tokens and extra_engine_args.compilation_config.max_cudagraph_capture_size both "
                "set: keep cuda_graph_max_tokens and drop the other")
        if self.cuda_graph_max_tokens is not None and self.enforce_eager:
            raise ValueError("cuda_graph_max_tokens is set but enforce_eager: true captures no CUDA graphs: "
                             "drop one of them")
        lora_args = set(self.extra_engine_args) & {"enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"}
        if lora_args:
            raise ValueError(f"extra_engine_args sets {sorted(lora_args)}: set the lane's engine.lora block instead "
                             "(max_loras, max_lora_rank, max_cpu_loras), which the Router and routing read too")
        clash = set(self.extra_engine_args) & set(type(self).model_fields)
        if clash:
            raise ValueError(
                f"extra_engine_args repeats {sorted(clash)}: set them as first-class fields of the lane's engine"
            )
        return self


class QueueDepthTargets(StrictModel):
    """The cold lane's queue-depth policy (app.batch.autoscaling): one replica per this much backlog."""

    target_lines_per_replica: float = Field(256, gt=0)
    target_backlog_tokens_per_replica: float = Field(262_144, gt=0)
    target_waiting_per_replica: float = Field(8, gt=0)
    target_ongoing_per_replica: float = Field(32, gt=0)
    scale_to_zero: bool = False


class AutoscalingSettings(StrictModel):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(16, gt=0)
    upscale_delay_s: float = Field(10, ge=0)
    downscale_delay_s: float = Field(60, ge=0)
    # How often replicas report autoscaling metrics (custom ones included) and over how long Ray averages them.
    metrics_interval_s: float = Field(10, gt=0)
    look_back_period_s: float = Field(30, gt=0)
    # Set: replicas follow the batch backlog and engine queues (custom Ray Serve policy); unset: Ray's default
    # policy on ongoing requests (target_ongoing_requests).
    queue_depth: QueueDepthTargets | None = None

    @model_validator(mode="after")
    def _check(self) -> "AutoscalingSettings":
        if self.queue_depth and self.queue_depth.scale_to_zero != (self.min_replicas == 0):
            raise ValueError(
                "queue_depth.scale_to_zero and min_replicas disagree: scale to zero needs min_replicas 0 "
                "(and min_replicas 0 needs scale_to_zero true)"
            )
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas} > max_replicas={self.max_replicas}: lower min_replicas "
                "or raise max_replicas"
            )
        return self


class LaneDeploymentSettings(StrictModel):
    """How Ray Serve runs a lane's replicas."""

    num_replicas: int = Field(1, ge=1)
    autoscaling: AutoscalingSettings | None = None
    num_cpus: float = Field(1, ge=0)
    # Fraction of a GPU per replica when tensor_parallel_size == 1 (e.g. 0.5 to share one GPU between lanes).
    # With tensor_parallel_size > 1 the replica gets a placement group of whole GPUs instead.
    num_gpus: float = Field(0, ge=0)
    max_ongoing_requests: int = Field(256, ge=1)
    health_check_period_s: float = Field(3, gt=0)
    health_check_timeout_s: float = Field(30, gt=0)
    graceful_shutdown_timeout_s: float = Field(20, ge=0)
    placement_group_strategy: Literal["STRICT_PACK", "PACK"] = "STRICT_PACK"
    # Environment of the lane's replica processes (and the engine processes they start), e.g.
    # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE to cap this lane's share of the GPU's SMs under the CUDA MPS daemon.
    env_vars: dict[str, str] = Field(default_factory=dict)
    # Ray custom resources each replica needs (Ray's `resources` actor option), e.g. {"lane_host": 1} to keep the
    # lane on the nodes started with `ray start --resources '{"lane_host": N}'`. Replicas of a lost node are started
    # again only where the resource is left.
    resources: dict[str, float] = Field(default_factory=dict)

    @property
    def min_replicas(self) -> int:
        """Replicas the lane has at its smallest: autoscaling.min_replicas when it autoscales, else num_replicas."""
        return self.autoscaling.min_replicas if self.autoscaling else self.num_replicas

    @property
    def max_replicas(self) -> int:
        """Replicas the lane has at its largest: autoscaling.max_replicas when it autoscales, else num_replicas."""
        return self.autoscaling.max_replicas if self.autoscaling else self.num_replicas

    @model_validator(mode="after")
    def _check(self) -> "LaneDeploymentSettings":
        reserved = {"CPU", "GPU", "memory", "object_store_memory"} & set(self.resources)
        if reserved:
            raise ValueError(f"resources names {sorted(reserved)}: set num_cpus / num_gpus instead; resources is "
                             "for custom resources")
        negative = sorted(name for name, amount in self.resources.items() if amount < 0)
        if negative:
            raise ValueError(f"resources {negative} < 0: give each custom resource an amount >= 0")
        if self.health_check_period_s >= MAX_HEALTH_CHECK_PERIOD_S:
            raise ValueError(
                f"health_check_period_s={self.health_check_period_s} is too slow: use less than "
                f"{MAX_HEALTH_CHECK_PERIOD_S} s (the tuning guide's health-check rule)"
            )
        return self


class LaneConfig(StrictModel):
    engine: EngineSettings = Field(default_factory=EngineSettings)
    deployment: LaneDeploymentSettings = Field(default_factory=LaneDeploymentSettings)
    # Completions asking for more are clipped to this, not refused (None: only max_model_len limits).
    max_tokens_cap: int | None = Field(None, ge=1)



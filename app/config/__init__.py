"""The one configuration schema of llm-lanes: AppConfig and its blocks (the lanes', auth and observability blocks in
modules of their own beside this one, all re-exported here).

Every serve config's `args:` block is validated here once, by `AppConfig.model_validate`, before any deployment is
built. Errors name the field and say how to fix it. Nothing in the app reads hidden environment variables; what is
configurable lives here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

# Re-exported: the app imports the whole schema from app.config.
from app.config.base import (  # noqa: F401
    ALLOWED_BLOCK_SIZES, CPU_BLOCK_MULTIPLE, MAX_HEALTH_CHECK_PERIOD_S, StrictModel, is_postgres_url, parse_cpu_list,
)
from app.config.lanes import (  # noqa: F401
    LORA_RANKS, AutoscalingSettings, EngineSettings, LaneConfig, LaneDeploymentSettings, LoraSettings,
    QueueDepthTargets,
)
from app.config.observability import TRACING_EXPORTERS, ObservabilityConfig, TracingConfig  # noqa: F401
from app.config.security import REQUEST_CLASS_NAMES, TENANT_PATTERN, ApiKeyConfig, AuthConfig  # noqa: F401


ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$"
# The adapter the lanes' engines run the base model's requests under on a CPU host (app/lanes/identity_adapter.py
# says why): no served adapter may take its name.
IDENTITY_ADAPTER_NAME = "llm-lanes-identity"


class LoraAdapterConfig(StrictModel):
    """A LoRA adapter of the base model, served under its own model name."""

    name: str = Field(pattern=ADAPTER_NAME_PATTERN, description="The name clients pass as `model` for it.")
    path: str = Field(min_length=1, description="Local folder of the adapter (PEFT's adapter_config.json and "
                                                "adapter_model.safetensors), on every node of the app.")


class ModelConfig(StrictModel):
    source: str = Field(description="Local path or Hugging Face id of the model (weights + tokenizer).")
    served_name: str = Field(description="The name clients pass as `model`.")
    max_model_len: int = Field(2048, gt=0, description="Prompt + completion limit in tokens, for every lane.")
    tokenizer: str | None = Field(None, description="Tokenizer path/id if it differs from `source`.")
    load_format: str | None = Field(
        None, description='vLLM load format; "dummy" runs a real model shape with random weights (benchmarks).'
    )
    # How the OpenAI surface renders and parses for this model: vLLM's own options of the same names.
    chat_template: str | None = Field(None, description="Chat template (a file path or the template itself) "
                                                         "instead of the tokenizer's.")
    tool_call_parser: str | None = Field(None, description='vLLM tool-call parser (e.g. "hermes"): needed for '
                                                            'tool_choice "auto" and "required" with tool calls parsed.')
    enable_auto_tool_choice: bool = Field(False, description='Honour tool_choice "auto" (needs tool_call_parser).')
    reasoning_parser: str | None = Field(None, description="vLLM reasoning parser: the answer's reasoning_content.")
    adapters: list[LoraAdapterConfig] = Field(
        default_factory=list, description="LoRA adapters served over this model, each under its own name (needs "
                                          "engine.lora on every lane).")

    @model_validator(mode="after")
    def _auto_tools_need_a_parser(self):
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("model.enable_auto_tool_choice needs model.tool_call_parser (e.g. hermes)")
        names = [adapter.name for adapter in self.adapters]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"model.adapters names {twice} more than once: give each adapter one entry")
        if self.served_name in names:
            raise ValueError(f"model.adapters: {self.served_name!r} is the base model's served_name: give the adapter "
                             "another name")
        return self

    @property
    def tokenizer_source(self) -> str:
        return self.tokenizer or self.source


class BreakerConfig(StrictModel):
    """Per-lane circuit breaker: open after `failure_threshold` consecutive failures within the window."""

    failure_threshold: int = Field(5, ge=1)
    failure_window_s: float = Field(30, gt=0)
    cooldown_s: float = Field(10, gt=0)
    half_open_max_probes: int = Field(1, ge=1)
    success_threshold: int = Field(2, ge=1)


class DeadlineConfig(StrictModel):
    """Request timeout per class: max(floor, p99_multiplier x rolling P99) -- the tuning guide's "timeout > 3xP99"."""

    realtime_timeout_floor_s: float = Field(15, gt=0)
    interactive_timeout_floor_s: float = Field(60, gt=0)
    batch_timeout_floor_s: float = Field(600, gt=0)
    p99_multiplier: float = Field(3.0, ge=1)
    window: int = Field(1000, ge=1)
    min_samples: int = Field(100, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "DeadlineConfig":
        if self.min_samples > self.window:
            raise ValueError(f"min_samples={self.min_samples} > window={self.window}: lower min_samples")
        return self


class AdmissionConfig(StrictModel):
    """Admission control in the Router and in front of each hot engine."""

    enabled: bool = Field(True, description="False: no gate, no back-pressure, no spill (a plain single pool).")
    # The tuning guide's high-priority queue of batch <= 4 per hot replica.
    realtime_max_inflight: int = Field(4, ge=1)
    # The tuning guide's 20 % of the KV pool kept for real-time requests.
    realtime_kv_reserve: float = Field(0.20, ge=0, lt=1)
    # The tuning guide's "> 8K tokens degrade to the memory-efficient path": long prompts go to the cold lane.
    long_context_threshold: int = Field(8192, ge=1)
    # Admitted interactive requests are to start within this: past a full hot lane, a request waits in the Router
    # for a hot slot only when its predicted wait is within it; otherwise it spills to the cold lane (while there
    # is spill room) or is refused with 429 (app/router/spill.py, rule 5).
    interactive_ttft_slo_s: float = Field(1.0, gt=0)
    # Admission's own decisions aim this share of the target lower: the first token still has to go back through
    # the HTTP proxy to the client, which the Router does not see, and its start estimates come from recent load.
    interactive_ttft_headroom: float = Field(0.1, ge=0, lt=1)
    # Realtime requests are to start within this. It only decides where a realtime request may be served degraded:
    # with no running hot replica, on the cold lane (at realtime priority) while that lane's recent first tokens
    # come within it, else 503 with Retry-After (app/router/spill.py, rule 6).
    realtime_ttft_slo_s: float = Field(0.5, gt=0)
    realtime_queue_bound: int = Field(32, ge=0)
    interactive_queue_bound: int = Field(128, ge=0)
    # With API keys of several tenants, one tenant may fill at most this share of a class's queue bound, so the
    # others' requests still find room while it floods (app/router/admission.py).
    tenant_queue_share: float = Field(0.75, gt=0, le=1)
    # Interactive requests each cold-lane replica takes on top of its batch work when the hot lane is full (they
    # run there at interactive priority, ahead of batch). None: an eighth of the cold engine's max_num_seqs (at
    # least 1): more would make the batch engine's steps, and so the spilled requests' first tokens, slow. 0: the
    # hot lane's queue or a 429 instead.
    cold_spill_slots_per_replica: int | None = Field(None, ge=0)
    # An interactive request on the hot lane generates this many tokens there (its time to first token), then the
    # cold lane decodes the rest at interactive priority, in its large batch steps (app/router/handoff.py). The hot
    # lane then spends no steps on interactive decode, which is what it costs the batch work on a shared GPU; the
    # interactive time per output token becomes the cold lane's step time. 0 (the default): the hot lane serves it all.
    interactive_decode_handoff_tokens: int = Field(0, ge=0)
    # This many hot-lane replicas are kept for realtime requests; interactive work goes to the others and reaches
    # these only when none of the others can take it (app/prefix_cache/realtime_reserve.py). An engine step cannot
    # be preempted, so a realtime prompt on a replica that prefills interactive prompts waits for their step. 0 (the
    # default): every hot replica serves both classes. Needs more hot replicas than this, and prefix_cache.routing
    # "affinity" (the lanes' own request router applies it).
    realtime_reserved_hot_replicas: int = Field(0, ge=0)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    deadlines: DeadlineConfig = Field(default_factory=DeadlineConfig)


class RouterConfig(StrictModel):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1, ge=0)
    max_ongoing_requests: int = Field(1024, ge=1)
    # Default completion length when the client sends no max_tokens.
    default_max_tokens: int = Field(256, ge=1)
    graceful_shutdown_timeout_s: float = Field(
        20, gt=0, description="How long a stopping Router replica (serve run stopped, serve deploy, scale-down) "
                              "keeps serving its open streams before it is killed: set it above the longest stream's "
                              "duration so a rolling update fails none. Half of it is the batch lines' time to finish.")
    # HTTP bodies and gRPC messages above this are refused (413, RESOURCE_EXHAUSTED) before they are parsed or
    # tokenized; file uploads and SubmitBatch are bounded by batch.max_file_bytes instead.
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    # Most chat messages in one request (400), checked before the chat template is rendered.
    max_messages: int = Field(10_000, ge=1)
    # Most choices (`n`) in one request (400): each is a sequence the engine runs; OpenAI's API takes 128 at most.
    max_choices: int = Field(128, ge=1)


class PrefixCacheConfig(StrictModel):
    """Prefix-affinity routing and the shared prefix index; defaults are the tuning guide's values."""

    routing: Literal["affinity", "pow2"] = Field(
        "affinity", description="affinity: route long prompts to the replica holding their prefix "
                                "(app.prefix_cache.request_router); pow2: Ray Serve's power-of-two-choices (baseline).")
    feed: Literal["kv_events", "approximate"] = Field(
        "kv_events", description="kv_events: exact, from each engine's vLLM KV-cache events; approximate: a replica "
                                 "records each long prompt it admits, forgotten after approximate_ttl_s unused.")
    approximate_ttl_s: float = Field(300, gt=0, description="approximate feed: entries unused this long are dropped.")
    match_threshold: float = Field(0.85, description="Route by affinity when match ratio >= this.")
    min_prefix_tokens: int = Field(1024, ge=1, description="Prompts shorter than this skip affinity.")
    adapter_spread_at: int = Field(8, ge=1, description="A LoRA adapter's requests go to the replicas holding it "
                                                        "until each of those runs this many; then to any replica "
                                                        "(app.prefix_cache.adapter_affinity).")
    max_queue_imbalance: int = Field(4, ge=0, description="Affinity yields when its replica's queue is this much "
                                                           "longer than the shortest queue.")
    kv_usage_weight: float = Field(8.0, ge=0, description="Load score = queue length + this x KV usage (0..1).")
    lookup: Literal["local_mirror", "remote"] = Field(
        "local_mirror", description="local_mirror: each Router process keeps a copy of the index, synced every "
                                    "mirror_sync_interval_s, and looks up locally; remote: one PrefixCache call per "
                                    "request, within lookup_timeout_s.")
    lookup_timeout_s: float = Field(0.005, gt=0, description="lookup: remote: budget of one index lookup; over it: "
                                                             "load-only.")
    mirror_sync_interval_s: float = Field(0.1, gt=0, description="lookup: local_mirror: how often a Router pulls "
                                                                   "the index's changes.")
    mirror_max_staleness_s: float = Field(2.0, gt=0, description="lookup: local_mirror: a copy not synced for this "
                                                                   "long is not used (load-only routing).")
    max_pinned_prefixes: int | None = Field(None, ge=0, description="Default: number of GPUs x 4.")
    warmup: bool = Field(True, description="A new replica prefills the pinned prefixes before it takes traffic.")
    warmup_timeout_s: float = Field(60, gt=0, description="Warm-up gives up (and the replica starts) after this.")
    popularity_half_life_s: float = Field(600, gt=0, description="Prefix reuse counts halve after this long.")
    max_entries: int = Field(200_000, ge=1, description="Bound on indexed blocks; least recently used go first.")
    num_cpus: float = Field(0.1, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "PrefixCacheConfig":
        if not 0 < self.match_threshold <= 1:
            raise ValueError(f"match_threshold={self.match_threshold} is out of range: use a ratio in (0, 1]")
        if self.mirror_max_staleness_s <= self.mirror_sync_interval_s:
            raise ValueError(f"mirror_max_staleness_s={self.mirror_max_staleness_s} must be longer than "
                             f"mirror_sync_interval_s={self.mirror_sync_interval_s}: raise it to a few sync intervals "
                             "(default 2.0 for 0.1)")
        return self


class BatchConfig(StrictModel):
    """Durable batch jobs (OpenAI Files + Batches API) drained into the cold lane."""

    store: str = Field(".data/batches.sqlite3", description="SQLite file path, or a postgresql:// URL (clusters).")
    max_file_bytes: int = Field(200 * 1024 * 1024, gt=0, description="Uploads above this get 413.")
    lease_s: float = Field(60, gt=0, description="A claimed line returns to the queue if not renewed this long.")
    max_attempts: int = Field(3, ge=1)
    poll_interval_s: float = Field(0.5, gt=0)
    # The tuning guide's dynamic batch of 16-32 requests in flight per cold-lane replica, adapted by an AIMD window.
    # Per replica: each Router replica dispatches its share, window x running ColdLane replicas / Router replicas,
    # so a lane that scales out gets work for every replica (app.batch.dispatcher.dispatch_capacity).
    window_min: int = Field(16, ge=1)
    window_max: int = Field(32, ge=1)
    target_latency_per_token_s: float = Field(0.1, gt=0)
    window_interval_s: float = Field(5, gt=0)
    # Double the window (instead of +1) per interval until throughput stops improving: a short job reaches
    # window_max in a few intervals rather than one slot per interval.
    window_slow_start: bool = True
    # true: every replica of this app runs on one machine (e.g. one 8-GPU host), so one SQLite file is shared by all;
    # see check_batch_store for when a SQLite store is refused without it.
    single_node: bool = False

    @model_validator(mode="after")
    def _check(self) -> "BatchConfig":
        if self.window_min > self.window_max:
            raise ValueError(f"window_min={self.window_min} > window_max={self.window_max}: lower window_min")
        return self

    @property
    def is_postgres(self) -> bool:
        return is_postgres_url(self.store)


def max_gpus(cfg: "AppConfig") -> float:
    """GPUs the lanes hold at their largest (autoscaling.max_replicas, else num_replicas, x GPUs per replica)."""
    total = 0.0
    for lane in (cfg.hot_lane, cfg.cold_lane):
        if lane is not None:
            scaling = lane.deployment.autoscaling
            total += (scaling.max_replicas if scaling else lane.deployment.num_replicas) * gpus_per_replica(lane)
    return total


def check_batch_store(cfg: "AppConfig") -> None:
    """A SQLite store is one file on one machine: Router and ColdLane replicas on other nodes would each open their
    own. The lanes can be on more than one node when device is gpu and, at their largest, they hold more than one
    GPU (Ray places replicas and tensor-parallel groups on any node with free GPUs); then the store must be
    PostgreSQL, unless batch.single_node says the whole app runs on one machine."""
    if cfg.batch.is_postgres or cfg.batch.single_node or cfg.device != "gpu":
        return
    gpus = max_gpus(cfg)
    if gpus > 1:
        raise ValueError(
            f"batch.store={cfg.batch.store!r} is a SQLite file, and the lanes can hold {gpus:g} GPUs, so their "
            "replicas can be on more than one node, each with its own file (batches uploaded through one Router "
            "invisible to the others, the cold lane's backlog empty): set batch.store to a postgresql:// URL, or "
            "batch.single_node: true if every replica runs on one machine"
        )


# The exporters app.observability.tracing builds (a unit test checks they match TracingConfig.exporter's values).
class AppConfig(StrictModel):
    """The `args:` of a serve config (`import_path: app.main:build_app`)."""

    name: str = "llm-lanes"
    device: Literal["cpu", "gpu"] = "gpu"
    model: ModelConfig
    hot_lane: LaneConfig = Field(default_factory=LaneConfig)
    # null: no cold lane -- one pool serves every class (the single-pool baseline).
    cold_lane: LaneConfig | None = Field(default_factory=LaneConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    prefix_cache: PrefixCacheConfig = Field(default_factory=PrefixCacheConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)

    @model_validator(mode="after")
    def _check(self) -> "AppConfig":
        for lane_name in ("hot_lane", "cold_lane"):
            lane = getattr(self, lane_name)
            if lane is not None:
                _check_lane(self, lane_name, lane)
                if (self.prefix_cache.feed == "kv_events" and self.keeps_prefix_index(lane)
                        and not lane.engine.enable_prefix_caching):
                    raise ValueError(
                        f"prefix_cache.feed='kv_events' needs {lane_name}.engine.enable_prefix_caching: true (an "
                        "engine without a prefix cache sends no KV events); or set prefix_cache.feed: approximate"
                    )
        if self.admission.interactive_decode_handoff_tokens and (self.cold_lane is None or self.hot_lane is None):
            raise ValueError("admission.interactive_decode_handoff_tokens hands interactive decode from the hot lane "
                             "to the cold lane, and this app has only one lane: set it to 0 or add the other lane")
        self._check_realtime_reserve()
        self._check_lora()
        check_batch_store(self)
        return self

    def _check_realtime_reserve(self) -> None:
        reserved = self.admission.realtime_reserved_hot_replicas
        if not reserved:
            return
        field = f"admission.realtime_reserved_hot_replicas={reserved}"
        if self.prefix_cache.routing != "affinity":
            raise ValueError(f"{field} is applied by the lanes' request router, which prefix_cache.routing="
                             f"'{self.prefix_cache.routing}' turns off: set prefix_cache.routing: affinity, or set "
                             "the reserve to 0")
        deployment = self.hot_lane.deployment
        where = "autoscaling.min_replicas" if deployment.autoscaling else "num_replicas"
        if deployment.min_replicas <= reserved:
            raise ValueError(f"{field} would leave no hot replica for interactive requests: hot_lane.deployment."
                             f"{where} is {deployment.min_replicas}; raise it above {reserved}, or lower the reserve")

    def _check_lora(self) -> None:
        """Adapters need LoRA on every lane: a request for one may run on either (spill, decode handoff, a lost
        lane's requests served by the other)."""
        if not self.model.adapters:
            return
        reserved = {self.model.served_name, IDENTITY_ADAPTER_NAME}
        for adapter in self.model.adapters:
            if adapter.name in reserved:
                raise ValueError(f"model.adapters: {adapter.name!r} is the base model's name or the lanes' identity "
                                 "adapter's: give the adapter another name")
        for lane_name in ("hot_lane", "cold_lane"):
            lane = getattr(self, lane_name)
            if lane is not None and lane.engine.lora is None:
                raise ValueError(f"model.adapters needs LoRA on every lane, and {lane_name}.engine.lora is not set: "
                                 f"add {lane_name}.engine.lora (e.g. {{max_loras: 2, max_lora_rank: 16}}), or drop "
                                 "model.adapters")

    @property
    def serves_lora(self) -> bool:
        """Whether the lanes' engines run vLLM's multi-LoRA (adapters configured or loadable at run time)."""
        return all(lane.engine.lora is not None for lane in (self.hot_lane, self.cold_lane) if lane is not None)

    @property
    def max_lora_rank(self) -> int | None:
        """The largest adapter rank every lane takes (None: no LoRA)."""
        if not self.serves_lora:
            return None
        return min(lane.engine.lora.max_lora_rank for lane in (self.hot_lane, self.cold_lane) if lane is not None)

    def keeps_prefix_index(self, lane: LaneConfig) -> bool:
        """Whether `lane`'s engines feed the shared prefix index from their KV events and its calls go through the
        prefix-affinity request router. Only a lane that can run more than one replica has a replica to choose: for
        one, the events, the index's copy in every Router and its syncs would cost CPU beside the engine for nothing."""
        return lane.deployment.max_replicas > 1

    def lane(self, name: str) -> LaneConfig:
        lane = {"hot": self.hot_lane, "cold": self.cold_lane}[name]
        if lane is None:
            raise KeyError(f"this app has no {name} lane")
        return lane

    @property
    def lane_names(self) -> list[str]:
        return ["hot"] + (["cold"] if self.cold_lane is not None else [])

    @property
    def total_gpus(self) -> int:
        """GPUs the app asks for at its minimum size (replicas x GPUs per replica, rounded up)."""
        total = 0.0
        for lane in (self.hot_lane, self.cold_lane):
            if lane is None:
                continue
            total += lane.deployment.min_replicas * gpus_per_replica(lane)
        return max(1, int(-(-total // 1))) if self.device == "gpu" else 0

    @property
    def pinned_prefix_limit(self) -> int:
        # The tuning guide: keep at most (number of GPUs x 4) hot prefixes pinned; one "GPU" on a CPU-only host.
        if self.prefix_cache.max_pinned_prefixes is not None:
            return self.prefix_cache.max_pinned_prefixes
        return max(1, self.total_gpus) * 4


def gpus_per_replica(lane: LaneConfig) -> float:
    tp = lane.engine.tensor_parallel_size
    return float(tp) if tp > 1 else lane.deployment.num_gpus


def placement_group_bundles(lane: LaneConfig) -> list[dict[str, float]] | None:
    """A TP group of N GPUs: the replica actor and rank 0 share the first bundle (with the replica's custom
    resources), one GPU per further rank."""
    tp = lane.engine.tensor_parallel_size
    if tp == 1:
        return None
    return ([{"GPU": 1, "CPU": lane.deployment.num_cpus, **lane.deployment.resources}]
            + [{"GPU": 1} for _ in range(tp - 1)])


def _check_lane(cfg: AppConfig, lane_name: str, lane: LaneConfig) -> None:
    engine, deployment = lane.engine, lane.deployment
    where = f"{lane_name}.engine"
    if cfg.model.max_model_len % engine.block_size:
        raise ValueError(
            f"model.max_model_len={cfg.model.max_model_len} is not a multiple of {where}.block_size="
            f"{engine.block_size}: pick a max_model_len divisible by the block size"
        )
    if cfg.device == "cpu":
        if engine.block_size % CPU_BLOCK_MULTIPLE:
            raise ValueError(
                f"{where}.block_size={engine.block_size} does not work on CPU: vLLM's CPU attention needs a "
                f"multiple of {CPU_BLOCK_MULTIPLE}"
            )
        if engine.kv_cache_memory_bytes is None:
            raise ValueError(
                f"{where}.kv_cache_memory_bytes is required on CPU: vLLM cannot size the KV cache from free memory "
                "there (e.g. 268435456 for 256 MiB)"
            )
        if engine.tensor_parallel_size != 1 or deployment.num_gpus:
            raise ValueError(f"{lane_name}: device is cpu, so use tensor_parallel_size 1 and num_gpus 0")
    else:
        if engine.tensor_parallel_size == 1 and deployment.num_gpus <= 0:
            raise ValueError(
                f"{lane_name}.deployment.num_gpus must be > 0 on GPU with tensor_parallel_size 1 "
                "(e.g. 1, or 0.5 for two lanes sharing one GPU)"
            )
        if engine.tensor_parallel_size > 1 and deployment.num_gpus not in (0, engine.tensor_parallel_size):
            raise ValueError(
                f"{lane_name}.deployment.num_gpus={deployment.num_gpus} contradicts tensor_parallel_size="
                f"{engine.tensor_parallel_size}: a TP replica gets whole GPUs from its placement group "
                f"{placement_group_bundles(lane)}; leave num_gpus at 0"
            )
    if deployment.autoscaling and deployment.num_replicas != 1:
        raise ValueError(f"{lane_name}.deployment: set num_replicas or autoscaling, not both")
    if lane.max_tokens_cap is not None and lane.max_tokens_cap >= cfg.model.max_model_len:
        raise ValueError(
            f"{lane_name}.max_tokens_cap={lane.max_tokens_cap} must be below model.max_model_len="
            f"{cfg.model.max_model_len}: lower it or leave it unset"
        )


def format_validation_error(error: ValidationError) -> str:
    """One line per problem: `field.path: message`, as an operator wants to read it."""
    lines = []
    for item in error.errors():
        path = ".".join(str(p) for p in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key; check its spelling against app/config/"
        lines.append(f"{path}: {message}")
    return "\n".join(lines)


class ConfigError(ValueError):
    pass


def load_app_config(args: dict[str, Any]) -> AppConfig:
    try:
        return AppConfig.model_validate(args)
    except ValidationError as error:
        raise ConfigError("invalid llm-lanes config:\n" + format_validation_error(error)) from None

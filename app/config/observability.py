"""observability: tracing and metrics settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from app.config.base import StrictModel


TRACING_EXPORTERS = ("none", "console", "otlp", "file", "memory")


class TracingConfig(StrictModel):
    """OpenTelemetry tracing (app.observability.tracing.setup_tracing; one trace per request)."""

    exporter: Literal["none", "console", "otlp", "file", "memory"] = Field(
        "none", description="none: no provider at all (tracing costs nothing); otlp: OTLP/HTTP to otlp_endpoint; "
                            "file: JSON lines to file_path (tests); console; memory (unit tests)."
    )
    otlp_endpoint: str | None = Field(None, description="e.g. http://otel-collector:4318/v1/traces")
    file_path: str | None = Field(None, description="file exporter: one JSON line per span, appended.")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="Head sampling at the Router; the rest follow it.")
    service_name: str = Field("llm-lanes", min_length=1)

    @model_validator(mode="after")
    def _check(self) -> "TracingConfig":
        if self.exporter == "otlp" and not self.otlp_endpoint:
            raise ValueError("exporter 'otlp' needs otlp_endpoint (e.g. http://otel-collector:4318/v1/traces)")
        if self.exporter == "file" and not self.file_path:
            raise ValueError("exporter 'file' needs file_path (e.g. /tmp/llm-lanes-spans.jsonl)")
        return self


class MemorySnapshotsConfig(StrictModel):
    """tracemalloc snapshots of every Router, lane and PrefixCache replica (app.observability.memory), for a soak:
    off unless `dir` is set, since tracing every allocation costs the replicas' Python code time and memory."""

    dir: str | None = Field(None, description="directory each replica writes its snapshots to, on its own node; "
                                              "None: no snapshots, no tracing")
    interval_s: float = Field(600.0, gt=0, description="seconds between two snapshots of one replica")
    frames: int = Field(1, ge=1, le=64, description="stack frames kept per allocation (1: the line that allocated)")


class ObservabilityConfig(StrictModel):
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    memory_snapshots: MemorySnapshotsConfig = Field(default_factory=MemorySnapshotsConfig)
    # vLLM's own engine metrics (ray_vllm_*) through its RayPrometheusStatLogger on Ray's metrics port.
    vllm_metrics: bool = True
    model_label_limit: int = Field(
        64, ge=1, description="adapters given a `model` label of their own in the per-model metrics "
                              "(llm_lanes_model_*) by each Router replica: the first this many adapter names it "
                              "serves; later ones share `other`. The base model always has its served name.")


"""Metric definitions: names, labels, buckets, and that they build and record with Ray's real metric classes
(constructed outside a replica and without ray.init: no cluster starts), plus the dashboard's agreement with them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.observability import metrics as m
from app.classes import Lane, RequestClass

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "cluster" / "grafana" / "llm-lanes-dashboard.json"
PROMETHEUS = REPO / "cluster" / "prometheus" / "prometheus.yml"


def test_names_prefix_and_uniqueness():
    names = [spec.name for spec in m.METRIC_SPECS]
    assert len(names) == len(set(names))
    for spec in m.METRIC_SPECS:
        assert spec.name.startswith(m.METRIC_PREFIX)
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", spec.name)
        assert spec.kind in ("counter", "gauge", "histogram")
        assert spec.name.endswith("_total") == (spec.kind == "counter")


def test_required_metrics_and_labels():
    expected = {
        "llm_lanes_ttft_seconds": ("lane", "request_class"),
        "llm_lanes_tpot_seconds": ("lane", "request_class"),
        "llm_lanes_e2e_seconds": ("lane", "request_class"),
        "llm_lanes_requests_total": ("lane", "request_class", "outcome", "status"),
        "llm_lanes_output_tokens_total": ("lane", "request_class"),
        "llm_lanes_model_requests_total": ("model", "outcome"),
        "llm_lanes_model_tokens_total": ("model", "kind"),
        "llm_lanes_model_ttft_seconds": ("model",),
        "llm_lanes_queue_depth": ("request_class",),
        "llm_lanes_admission_decisions_total": ("decision", "reason", "request_class"),
        "llm_lanes_degrade_total": ("reason", "request_class"),
        "llm_lanes_router_decision_seconds": ("request_class",),
        "llm_lanes_kv_cache_usage": ("lane",),
        "llm_lanes_prefix_cache_hit_rate": ("lane",),
        "llm_lanes_batch_backlog_lines": (),
    }
    for name, tag_keys in expected.items():
        assert m.METRICS_BY_NAME[name].tag_keys == tag_keys
    for spec in m.METRIC_SPECS:
        # Serve adds these itself inside a replica and raises if a metric declares them.
        assert not m.SERVE_RESERVED_TAGS & set(spec.tag_keys), spec.name


def test_histogram_buckets_are_increasing_positive_and_hold_the_goals():
    for spec in m.METRIC_SPECS:
        if spec.kind != "histogram":
            assert spec.boundaries is None
            continue
        bounds = spec.boundaries
        assert bounds and all(b > 0 for b in bounds)
        assert list(bounds) == sorted(set(bounds)), spec.name
    assert 0.45 in m.TTFT_BUCKETS_S  # realtime P99 goal
    assert 0.002 in m.ROUTER_DECISION_BUCKETS_S  # router overhead p50 goal
    assert m.E2E_BUCKETS_S[-1] >= 3600  # batch work
    assert m.MODEL_TTFT.boundaries == m.TTFT.boundaries  # per-model TTFT reads against the same goal


def test_exported_names_carry_rays_prefix():
    assert m.TTFT.exported_names() == (
        "ray_llm_lanes_ttft_seconds_bucket",
        "ray_llm_lanes_ttft_seconds_sum",
        "ray_llm_lanes_ttft_seconds_count",
    )
    assert m.REQUESTS.exported_names() == ("ray_llm_lanes_requests_total",)


def test_tpot_seconds():
    assert m.tpot_seconds(e2e_s=1.0, ttft_s=0.1, output_tokens=10) == pytest.approx(0.1)
    assert m.tpot_seconds(e2e_s=1.0, ttft_s=0.1, output_tokens=1) is None


class _Recorder:
    """A stand-in metric class that keeps what the wrapper records."""

    def __init__(self, name, description="", boundaries=None, tag_keys=None):
        self.name, self.boundaries, self.tag_keys, self.records = name, boundaries, tag_keys, []

    def observe(self, value, tags=None):
        self.records.append(("observe", value, tags))

    def inc(self, value=1.0, tags=None):
        self.records.append(("inc", value, tags))

    def set(self, value, tags=None):
        self.records.append(("set", value, tags))


def test_wrapper_converts_enums_and_status_codes_to_string_tags():
    fake = SimpleNamespace(Counter=_Recorder, Gauge=_Recorder, Histogram=_Recorder)
    metrics = m.LlmLanesMetrics(metrics_module=fake)
    metrics.observe_ttft(0.2, lane=Lane.HOT, request_class=RequestClass.REALTIME)
    metrics.count_request(lane=m.LANE_NONE, request_class=RequestClass.INTERACTIVE, outcome="rejected", status=429)
    metrics.set_batch_backlog(12)
    built = metrics._metrics
    assert built["llm_lanes_ttft_seconds"].boundaries == list(m.TTFT_BUCKETS_S)
    assert built["llm_lanes_ttft_seconds"].records == [
        ("observe", 0.2, {"lane": "hot", "request_class": "realtime"})
    ]
    assert built["llm_lanes_requests_total"].records == [
        ("inc", 1.0, {"lane": "none", "request_class": "interactive", "outcome": "rejected", "status": "429"})
    ]
    assert built["llm_lanes_batch_backlog_lines"].records == [("set", 12.0, {})]
    with pytest.raises(ValueError):
        metrics.count_request(lane="hot", request_class="batch", outcome="fine", status=200)
    with pytest.raises(ValueError):
        metrics.count_admission(decision="maybe", reason="x", request_class="batch")
    with pytest.raises(ValueError):
        metrics.count_model_request(model="tiny", outcome="fine")
    with pytest.raises(ValueError):
        metrics.count_model_tokens(3, model="tiny", kind="cached")


def test_every_method_records_through_rays_real_metric_classes():
    import ray.serve.metrics  # import only; recording without ray.init is accepted and validated

    metrics = m.LlmLanesMetrics()
    assert isinstance(metrics._metrics["llm_lanes_ttft_seconds"], ray.serve.metrics.Histogram)
    # Ray validates here: tag values must be str and every tag key must have a value.
    metrics.observe_ttft(0.1, lane=Lane.HOT, request_class=RequestClass.REALTIME)
    metrics.observe_tpot(0.02, lane=Lane.COLD, request_class=RequestClass.BATCH)
    metrics.observe_e2e(3.0, lane=Lane.HOT, request_class=RequestClass.INTERACTIVE)
    metrics.count_request(lane=Lane.HOT, request_class=RequestClass.REALTIME, outcome="success", status=200)
    metrics.count_output_tokens(17, lane=Lane.HOT, request_class=RequestClass.REALTIME)
    metrics.count_output_tokens(0, lane=Lane.HOT, request_class=RequestClass.REALTIME)  # skipped, not an error
    metrics.count_model_request(model="tiny-a", outcome="success")
    metrics.count_model_tokens(12, model="tiny-a", kind="prompt")
    metrics.count_model_tokens(0, model="tiny-a", kind="output")  # skipped, not an error
    metrics.observe_model_ttft(0.1, model="tiny")
    metrics.set_queue_depth(3, request_class=RequestClass.INTERACTIVE)
    metrics.observe_queue_wait(0.05, request_class=RequestClass.INTERACTIVE)
    metrics.count_admission(decision="reject", reason="queue_full", request_class=RequestClass.INTERACTIVE)
    metrics.count_degrade(reason="long_prompt", request_class=RequestClass.INTERACTIVE)
    metrics.observe_router_decision(0.0007, request_class=RequestClass.REALTIME)
    metrics.set_kv_cache_usage(0.42, lane=Lane.HOT)
    metrics.set_prefix_cache_hit_rate(0.9, lane=Lane.COLD)
    metrics.set_batch_backlog(0)
    with pytest.raises(ValueError, match="Missing value for tag key"):
        metrics._metrics["llm_lanes_kv_cache_usage"].set(0.1, tags={})


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    return exprs


def test_dashboard_queries_only_metrics_that_exist():
    exported = {name for spec in m.METRIC_SPECS for name in spec.exported_names()}
    used = set()
    for expr in _dashboard_exprs():
        used.update(re.findall(r"\bray_llm_lanes_[a-z0-9_]+", expr))
    assert used, "the dashboard should chart llm_lanes metrics"
    assert used <= exported, used - exported
    charted = {re.sub(r"_(bucket|count|sum)$", "", name) for name in used}
    assert {spec.name for spec in m.METRIC_SPECS} == {name.removeprefix("ray_") for name in charted}
    # The charts the issue asks for are all there.
    joined = "\n".join(_dashboard_exprs())
    for needle in (
        "histogram_quantile(0.99, sum by (le, lane) (rate(ray_llm_lanes_ttft_seconds_bucket",
        "ray_llm_lanes_queue_depth",
        "ray_llm_lanes_kv_cache_usage",
        "ray_llm_lanes_prefix_cache_hit_rate",
        "ray_serve_deployment_replica_healthy",
        "ray_vllm_",
    ):
        assert needle in joined, needle


def test_committed_dashboard_matches_its_generator():
    import importlib.util

    builder = REPO / "cluster" / "grafana" / "build_dashboard.py"
    spec = importlib.util.spec_from_file_location("build_dashboard", builder)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert json.loads(DASHBOARD.read_text()) == module.build()


def test_dashboard_is_importable_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        for target in panel.get("targets", []):
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_prometheus_config_scrapes_rays_service_discovery_file():
    import yaml

    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    files = jobs["ray"]["file_sd_configs"][0]["files"]
    assert "/tmp/ray/prom_metrics_service_discovery.json" in files

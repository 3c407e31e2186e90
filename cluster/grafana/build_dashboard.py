"""Writes cluster/grafana/llm-lanes-dashboard.json (the committed dashboard) from the panel list below.

    .venv/bin/python cluster/grafana/build_dashboard.py

Names are the ones Ray's metrics export port serves: every application metric gets the "ray_" prefix
(app/observability/metrics.py defines ours), vLLM's engine metrics arrive as ray_vllm_* through
RayPrometheusStatLogger and carry no Serve labels, so they are joined to their deployment (HotLane / ColdLane) on
the WorkerId label Ray puts on every metric, the way Ray's own Serve LLM dashboard does.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("llm-lanes-dashboard.json")
APP = 'application=~"$application"'
RATE = "$__rate_interval"
# vLLM metrics -> (deployment, replica) of the Serve replica that runs the engine.
WORKER_JOIN = (
    " * on (WorkerId) group_left (deployment, replica) max by (WorkerId, deployment, replica) "
    f"(ray_serve_deployment_request_counter_total{{{APP}}} * 0 + 1)"
)


def quantile(q: float, metric: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{APP}}}[{RATE}])))"


def target(expr: str, legend: str, ref: str = "A") -> dict:
    return {"datasource": {"type": "prometheus", "uid": "${datasource}"}, "expr": expr, "legendFormat": legend,
            "refId": ref}  # fmt: skip


def panel(title: str, targets: list[dict], unit: str, description: str = "", max_value: float | None = None,
          thresholds: list[tuple[str, float | None]] | None = None) -> dict:  # fmt: skip
    defaults: dict = {"unit": unit, "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10}}
    if max_value is not None:
        defaults["max"] = max_value
        defaults["min"] = 0
    if thresholds:
        defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in thresholds]}
        defaults["custom"]["thresholdsStyle"] = {"mode": "line"}
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},  # fmt: skip
        "targets": targets,
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


GOAL_TTFT = [("green", None), ("red", 0.45)]
GOAL_ROUTER = [("green", None), ("red", 0.002)]

SECTIONS: list[tuple[str, list[dict]]] = [
    ("Latency (lanes side by side)", [
        panel("TTFT p99 by lane", [
            target(quantile(0.99, "ray_llm_lanes_ttft_seconds", "lane"), "{{lane}} p99"),
            target(quantile(0.5, "ray_llm_lanes_ttft_seconds", "lane"), "{{lane}} p50"),
        ], "s", "Time to first token at the Router. Red line: the realtime P99 goal (450 ms).", thresholds=GOAL_TTFT),
        panel("TTFT p99 by request class", [
            target(quantile(0.99, "ray_llm_lanes_ttft_seconds", "request_class"), "{{request_class}} p99"),
        ], "s", "Realtime should stay under the line while batch traffic runs.", thresholds=GOAL_TTFT),
        panel("TPOT p50 / p99 by lane", [
            target(quantile(0.5, "ray_llm_lanes_tpot_seconds", "lane"), "{{lane}} p50"),
            target(quantile(0.99, "ray_llm_lanes_tpot_seconds", "lane"), "{{lane}} p99"),
        ], "s", "Time per output token after the first, one observation per request."),
        panel("E2E p99 by lane and class", [
            target(quantile(0.99, "ray_llm_lanes_e2e_seconds", "lane, request_class"),
                   "{{lane}} / {{request_class}}"),
        ], "s"),
        panel("Router decision time p50 / p99", [
            target(quantile(0.5, "ray_llm_lanes_router_decision_seconds", "request_class"), "{{request_class}} p50"),
            target(quantile(0.99, "ray_llm_lanes_router_decision_seconds", "request_class"), "{{request_class}} p99"),
        ], "s", "Classify + admit + lane/replica choice, without queue wait. Red line: the 2 ms p50 goal.",
            thresholds=GOAL_ROUTER),
        panel("Request body receive p50 / p99", [
            target(f"histogram_quantile(0.5, sum by (le) (rate(ray_llm_lanes_request_receive_seconds_bucket{{{APP}}}"
                   f"[{RATE}])))", "p50"),
            target(f"histogram_quantile(0.99, sum by (le) (rate(ray_llm_lanes_request_receive_seconds_bucket{{{APP}}}"
                   f"[{RATE}])))", "p99"),
        ], "s", "Router arrival to the request's body in hand, fetched from Serve's HTTP proxy: a busy proxy shows "
                "here, before the Router's TTFT starts."),
        panel("Inter-token latency p99 (vLLM)", [
            target("histogram_quantile(0.99, sum by (le, deployment) (rate(ray_vllm_inter_token_latency_seconds_bucket"
                   f"[{RATE}]){WORKER_JOIN}))", "{{deployment}}"),
        ], "s", "vLLM's own per-token histogram, per lane deployment."),
    ]),
    ("Throughput", [
        panel("Requests/s by lane and outcome", [
            target(f"sum by (lane, outcome) (rate(ray_llm_lanes_requests_total{{{APP}}}[{RATE}]))",
                   "{{lane}} {{outcome}}"),
        ], "reqps"),
        panel("Output tokens/s by lane and class", [
            target(f"sum by (lane, request_class) (rate(ray_llm_lanes_output_tokens_total{{{APP}}}[{RATE}]))",
                   "{{lane}} / {{request_class}}"),
        ], "short"),
        panel("Errors/s by status", [
            target(f'sum by (status, lane) (rate(ray_llm_lanes_requests_total{{{APP}, outcome!="success"}}[{RATE}]))',
                   "{{status}} {{lane}}"),
        ], "reqps"),
    ]),
    ("Models and adapters", [
        panel("Requests/s by model and outcome", [
            target(f"sum by (model, outcome) (rate(ray_llm_lanes_model_requests_total{{{APP}}}[{RATE}]))",
                   "{{model}} {{outcome}}"),
        ], "reqps", "The base model under its served name, each adapter under its own (`other`: adapters past "
                    "observability.model_label_limit)."),
        panel("Tokens/s by model (prompt / output)", [
            target(f"sum by (model, kind) (rate(ray_llm_lanes_model_tokens_total{{{APP}}}[{RATE}]))",
                   "{{model}} {{kind}}"),
        ], "short"),
        panel("TTFT p50 / p99 by model", [
            target(quantile(0.99, "ray_llm_lanes_model_ttft_seconds", "model"), "{{model}} p99"),
            target(quantile(0.5, "ray_llm_lanes_model_ttft_seconds", "model"), "{{model}} p50"),
        ], "s", "Streamed requests. Red line: the realtime P99 goal (450 ms).", thresholds=GOAL_TTFT),
    ]),
    ("Queues and admission", [
        panel("Admission queue depth by class", [
            target(f"sum by (request_class) (ray_llm_lanes_queue_depth{{{APP}}})", "{{request_class}}"),
        ], "short", "Summed over Router replicas."),
        panel("Queue wait p99 by class", [
            target(quantile(0.99, "ray_llm_lanes_queue_wait_seconds", "request_class"), "{{request_class}}"),
        ], "s"),
        panel("Admission decisions/s", [
            target(f"sum by (decision, reason) (rate(ray_llm_lanes_admission_decisions_total{{{APP}}}[{RATE}]))",
                   "{{decision}}: {{reason}}"),
        ], "short"),
        panel("Degrade / spill /s by reason", [
            target(f"sum by (reason, request_class) (rate(ray_llm_lanes_degrade_total{{{APP}}}[{RATE}]))",
                   "{{reason}} ({{request_class}})"),
        ], "short"),
        panel("Engine running / waiting by lane (vLLM scheduler)", [
            target(f"sum by (deployment) (ray_vllm_num_requests_running{WORKER_JOIN})", "{{deployment}} running"),
            target(f"sum by (deployment) (ray_vllm_num_requests_waiting{WORKER_JOIN})", "{{deployment}} waiting"),
        ], "short", "The tuning guide's get_engine_stats()['scheduler']['running'], per lane."),
        panel("Batch backlog (lines)", [
            target(f"max(ray_llm_lanes_batch_backlog_lines{{{APP}}})", "backlog"),
        ], "short", "max, not sum: every reporting replica reads the same shared store."),
    ]),
    ("Engines, caches and replicas", [
        panel("KV cache usage by lane and replica", [
            target(f"max by (lane, replica) (ray_llm_lanes_kv_cache_usage{{{APP}}})", "{{lane}} {{replica}}"),
        ], "percentunit", max_value=1),
        panel("Prefix cache hit rate by lane and replica", [
            target(f"max by (lane, replica) (ray_llm_lanes_prefix_cache_hit_rate{{{APP}}})", "{{lane}} {{replica}}"),
        ], "percentunit", max_value=1),
        panel("Healthy replicas by deployment", [
            target(f"sum by (deployment) (ray_serve_deployment_replica_healthy{{{APP}}})", "{{deployment}}"),
        ], "short", "ColdLane's count follows its queue-depth autoscaling policy."),
        panel("vLLM prefix cache hit rate by lane", [
            target(f"sum by (deployment) (rate(ray_vllm_prefix_cache_hits_total[{RATE}]){WORKER_JOIN}) / "
                   f"sum by (deployment) (rate(ray_vllm_prefix_cache_queries_total[{RATE}]){WORKER_JOIN})",
                   "{{deployment}}"),
        ], "percentunit", "Tokens served from the prefix cache / tokens queried, from vLLM's counters.", max_value=1),
        panel("Replica routing: decision time p99 and reasons", [
            target("histogram_quantile(0.99, sum by (le, lane) "
                   f"(rate(ray_llm_lanes_replica_routing_seconds_bucket{{{APP}}}[{RATE}])))", "p99 {{lane}}"),
            target(f"sum by (lane, reason) (rate(ray_llm_lanes_replica_routing_seconds_count{{{APP}}}[{RATE}]))",
                   "{{lane}} {{reason}}/s"),
        ], "s", "Prefix-affinity request router: time to pick a lane replica (index lookup + load) and why "
                "(affinity, no_match, below_threshold, imbalanced, short_prompt, lookup_failed)."),
    ]),
]


def build() -> dict:
    panels: list[dict] = []
    next_id, y = 1, 0
    width, height = 8, 8
    for title, section in SECTIONS:
        header = row(title)
        header["id"], header["gridPos"] = next_id, {"x": 0, "y": y, "w": 24, "h": 1}
        panels.append(header)
        next_id, y = next_id + 1, y + 1
        for i, p in enumerate(section):
            p["id"] = next_id
            p["gridPos"] = {"x": (i % 3) * width, "y": y + (i // 3) * height, "w": width, "h": height}
            panels.append(p)
            next_id += 1
        y += ((len(section) + 2) // 3) * height
    return {
        "uid": "llm-lanes",
        "title": "llm-lanes",
        "description": "Hot and cold lanes side by side: latency, throughput, queues, caches, replicas.",
        "tags": ["llm-lanes", "ray-serve", "vllm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source",
             "current": {}, "hide": 0, "refresh": 1},
            {"name": "application", "type": "custom", "label": "Serve application", "query": "llm-lanes",
             "current": {"text": "llm-lanes", "value": "llm-lanes"},
             "options": [{"text": "llm-lanes", "value": "llm-lanes", "selected": True}], "hide": 0},
        ]},  # fmt: skip
        "annotations": {"list": []},
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {OUT}")

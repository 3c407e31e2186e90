"""The LoRA routing benchmark's pure parts: the Zipf arrivals, the served configs of both routings, the found-loaded
counts read from the admin stats, the report, and --dry-run (no Ray)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from app.config import load_app_config
from load_tests import lora_routing as bench
from load_tests.overlay import llm_lanes_application

REPO = Path(__file__).resolve().parents[2]


def test_zipf_weights_fall_with_rank_and_sum_to_one():
    weights = bench.zipf_weights(8, 1.1)
    assert sum(weights) == pytest.approx(1.0)
    assert weights == sorted(weights, reverse=True)
    assert weights[0] / weights[1] == pytest.approx(2 ** 1.1)
    assert bench.zipf_weights(4, 0.0) == [0.25] * 4


def test_the_arrival_plan_is_seeded_poisson_over_zipf_ranks():
    names = bench.adapter_names()
    plan = bench.arrival_plan(4.0, 45.0, names, 1.1, seed=7)
    assert plan == bench.arrival_plan(4.0, 45.0, names, 1.1, seed=7)
    assert plan != bench.arrival_plan(4.0, 45.0, names, 1.1, seed=8)
    times = [at for at, _ in plan]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 45.0
    long = bench.arrival_plan(20.0, 1000.0, names, 1.1, seed=1)
    assert len(long) == pytest.approx(20_000, rel=0.03)
    counts = Counter(name for _, name in long)
    for name, weight in zip(names, bench.zipf_weights(8, 1.1)):
        assert counts[name] / len(long) == pytest.approx(weight, abs=0.015)


@pytest.mark.parametrize("label, routing, router", [
    ("adapter-aware", "affinity", "PrefixAffinityRouter"), ("default", "pow2", "LaneRouter")])
def test_each_run_serves_the_overlay_with_its_routing_and_a_store_of_its_own(tmp_path, label, routing, router):
    from app.main import lane_request_router_config

    document = bench.served_config(str(REPO / bench.OVERLAY), label, tmp_path / label)
    cfg = load_app_config(llm_lanes_application(document)["args"])
    assert cfg.prefix_cache.routing == routing
    assert cfg.batch.store == str((tmp_path / label / "batches.sqlite3").resolve())
    cold = cfg.cold_lane
    assert cold.deployment.num_replicas == 2
    assert (cold.engine.lora.max_loras, cold.engine.lora.max_cpu_loras) == (4, 4)
    assert cfg.serves_lora and not cfg.model.adapters  # loaded at run time, through the admin endpoint
    assert lane_request_router_config(cfg, cold)["request_router_class"].endswith(":" + router)


def test_found_loaded_counts_are_the_phases_own_over_the_cold_replicas():
    def stats(counts):
        return {"lanes": {"hot": [{"replica_id": "h", "adapter_residency": {"found_loaded": 9, "had_to_load": 9}}],
                          "cold": [{"replica_id": r, "adapter_residency": {"found_loaded": f, "had_to_load": h}}
                                   for r, (f, h) in counts.items()] + [{"error": "timed out"}]}}

    before = bench.residency_by_replica(stats({"a": (1, 2)}))
    after = bench.residency_by_replica(stats({"a": (10, 4), "b": (8, 1)}))
    assert bench.residency_delta(before, after) == {
        "found_loaded": 17, "had_to_load": 3, "share": 0.85,
        "by_replica": {"a": {"found_loaded": 9, "had_to_load": 2}, "b": {"found_loaded": 8, "had_to_load": 1}}}
    assert bench.residency_delta({}, {})["share"] is None


def phase(p50: float, p99: float, tokens_per_s: float) -> dict:
    return {"ttft_ms": {"p50": p50, "p99": p99}, "output_tokens_per_s": tokens_per_s, "errors": {},
            "requests_by_model": {"lora-1": 3}}


def test_the_report_gives_each_routing_its_row_and_a_failed_run_its_reason():
    plan = bench.arrival_plan(4.0, 10.0, bench.adapter_names(), 1.1, seed=7)
    report = {
        "settings": {"rate": 4.0, "duration_s": 10.0, "seed": 7, "prompt_tokens": 64, "max_tokens": 32},
        "plan": bench.plan_summary(plan, bench.adapter_names(), 4),
        "runs": {"adapter-aware": {"adapter_load_s": {"lora-1": 0.5, "lora-2": 0.7, "lora-3": 2.0},
                                   "residency": {"found_loaded": 9, "had_to_load": 1, "share": 0.9,
                                                 "by_replica": {}},
                                   "adapter_routing": {"adapter_loaded": 9}, "adapters": phase(60.0, 240.0, 120.0),
                                   "base": phase(50.0, 200.0, 125.0),
                                   "vs_base": {"ttft_p50": 1.2, "ttft_p99": 1.2, "output_tokens_per_s": 0.96}},
                 "default": {"error": "serve run exited"}},
    }
    assert report["plan"]["share_of_the_most_popular_that_fit"] == pytest.approx(0.7895, abs=1e-4)
    markdown = bench.render_markdown(report)
    assert "| adapter-aware | 90.0 % (9 / 10) | 60.0 / 240.0 | 50.0 / 200.0 | 1.20 | 0.96 | 0.70 / 2.00 |" in markdown
    assert "| default | failed: serve run exited |" in markdown
    assert "79%" in markdown


def test_dry_run_writes_both_served_configs_and_prints_the_plan(tmp_path, capsys):
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--duration", "10", "--seed", "3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["plan"]["requests"] == len(bench.arrival_plan(4.0, 10.0, bench.adapter_names(), 1.1, 3))
    for label, routing in bench.ROUTINGS.items():
        served = yaml.safe_load((tmp_path / label / "served-lora-routing.yaml").read_text())
        assert llm_lanes_application(served)["args"]["prefix_cache"]["routing"] == routing
    assert not (tmp_path / "adapters").exists() and not (tmp_path / "report.json").exists()

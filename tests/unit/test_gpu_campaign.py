"""The GPU campaign (load_tests/gpu_campaign.sh + load_tests/gpu_campaign.py), its serve configs and scenarios.

No GPU, no Ray: the shell script runs end to end against stand-ins for `ray`, `serve` and `nvidia-smi` on PATH, with
a small OpenAI-compatible server (standard library) in place of the app. It streams token chunks without text, as
the Llama-8B-shaped dummy model does, so the scenarios' count_empty_chunks path is exercised too.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from load_tests import gpu_campaign as gc
from load_tests.client import RequestSpec, send
from load_tests.scenario import load_scenario

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "load_tests" / "gpu_campaign.sh"
MODEL = "llama-8b-dummy"


# --------------------------------------------------------------------------------------------------------------------
# configs and scenarios
# --------------------------------------------------------------------------------------------------------------------


def _args(name: str) -> dict:
    """A shipped config's args, or an overlay's (load_tests/configs) merged onto its base."""
    from load_tests.overlay import load_serve_config

    path = REPO / "serve_configs" / name
    if not path.exists():
        path = REPO / "load_tests" / "configs" / name
    return load_serve_config(path)["applications"][0]["args"]


def test_baseline_is_one_engine_on_the_whole_gpu_without_admission():
    args = _args("baseline-gpu.yaml")
    assert args["cold_lane"] is None and args["admission"] == {"enabled": False}
    hot = args["hot_lane"]
    assert hot["engine"]["gpu_memory_utilization"] == 0.85 and hot["engine"]["max_num_seqs"] == 256
    assert hot["deployment"]["num_gpus"] == 1
    # Every request of the GPU scenario must reach the one engine's queue, not wait in front of it in Serve.
    scenario = load_scenario(REPO / "load_tests/scenarios/gpu_mixed.yaml")
    assert hot["deployment"]["max_ongoing_requests"] >= scenario.expected_requests()


def test_tuned_lanes_share_one_gpu_and_fit_the_batch():
    args = _args("gpu-lanes-tuned.yaml")
    hot, cold = args["hot_lane"], args["cold_lane"]
    assert hot["deployment"]["num_gpus"] + cold["deployment"]["num_gpus"] == 1
    assert hot["engine"]["gpu_memory_utilization"] + cold["engine"]["gpu_memory_utilization"] <= 0.90
    from app.tools.kv_budget.budget import compute_budget
    from app.tools.kv_budget.cli import parse_args
    from app.tools.kv_budget.inputs import build_inputs
    from app.tools.make_tiny_model import LLAMA31_8B_CONFIG

    # 140.4 GiB (the H200) x 0.70 - weights - 2 GiB reserve: all 256 cold sequences of 2,048 + 256 tokens resident.
    config = Path(os.environ.get("TMPDIR", "/tmp")) / f"llama8b-shape-{os.getpid()}.json"
    config.write_text(json.dumps(LLAMA31_8B_CONFIG))
    try:
        inputs = build_inputs(parse_args([
            "--model", str(config), "--gpu-memory-gib", "140.4", "--reserve-gib", "2", "--max-seq-len", "8192",
            "--gpu-memory-utilization", str(cold["engine"]["gpu_memory_utilization"]), "--context", "2304"]))
        assert compute_budget(inputs).max_concurrent_sequences >= cold["engine"]["max_num_seqs"]
    finally:
        config.unlink()


@pytest.mark.parametrize("name", ["gpu-lanes-tuned.yaml", "gpu-single.yaml", "baseline-gpu.yaml",
                                  "baseline-gpu-priority.yaml"])
def test_campaign_configs_validate(name):
    from app.config import load_app_config

    assert load_app_config(_args(name)).model.served_name == MODEL


def test_gpu_scenarios_have_issue_7_shape():
    mixed = load_scenario(REPO / "load_tests/scenarios/gpu_mixed.yaml")
    streams = {s.request_class: s for s in mixed.streams}
    batch = streams["batch"]
    assert (batch.arrival.type, batch.arrival.n, batch.prompt_tokens.value, batch.max_tokens) == ("burst", 512, 2048, 256)
    assert batch.ignore_eos and batch.service_tier == "flex"
    assert streams["interactive"].arrival.rate == 4 and streams["interactive"].max_tokens == 32
    assert streams["realtime"].arrival.rate == 0.5 and streams["realtime"].service_tier == "priority"
    assert mixed.slo["interactive"].ttft_ms == 100 and mixed.slo["realtime"].ttft_ms == 50
    assert mixed.count_empty_chunks and mixed.model == MODEL
    shared = load_scenario(REPO / "load_tests/scenarios/gpu_shared_prefix.yaml")
    assert shared.count_empty_chunks and any(s.shared_prefix for s in shared.streams)
    # gpu_mixed_rt2 differs only in the realtime rate (enough realtime requests for a p99 that is not the maximum)
    # and its seed: its own prompts, which gpu_mixed run before it on the same engines has not put in the cache.
    rt2 = load_scenario(REPO / "load_tests/scenarios/gpu_mixed_rt2.yaml")
    assert {s.request_class: s for s in rt2.streams}["realtime"].arrival.rate == 2
    assert rt2.seed != mixed.seed
    assert (rt2.model_copy(update={"name": mixed.name, "description": mixed.description, "streams": mixed.streams,
                                   "seed": mixed.seed}) == mixed)
    seeds = [load_scenario(REPO / f"load_tests/scenarios/{name}.yaml").seed
             for name in ("gpu_mixed", "gpu_mixed_rt2", "gpu_mixed_rt4", "gpu_shared_prefix")]
    assert len(set(seeds)) == len(seeds)
    assert [s.model_copy(update={"arrival": None}) for s in rt2.streams] == [
        s.model_copy(update={"arrival": None}) for s in mixed.streams]


# --------------------------------------------------------------------------------------------------------------------
# count_empty_chunks in the client
# --------------------------------------------------------------------------------------------------------------------


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _chat_chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


STREAM = _sse(_chat_chunk({"role": "assistant", "content": ""}), _chat_chunk({}), _chat_chunk({}),
              _chat_chunk({"content": "hi"}), _chat_chunk({}, "length"),
              {"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens": 3}}, "[DONE]")


@pytest.mark.parametrize("count_empty, chunks", [(False, 1), (True, 4)])
def test_empty_token_chunks_count_only_when_asked(count_empty, chunks):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=STREAM, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as client:
            spec = RequestSpec("s", "interactive", 0, "chat", True, {"model": MODEL, "messages": [], "stream": True})
            return await send(client, spec, time.perf_counter(), [], 10, count_empty_chunks=count_empty)

    record = asyncio.run(go())
    assert record.ok and record.output_tokens == 4
    assert len(record.chunk_offsets_s) == chunks and record.ttft_s == record.chunk_offsets_s[0]


# --------------------------------------------------------------------------------------------------------------------
# summary logic
# --------------------------------------------------------------------------------------------------------------------


def _stats(hot_usage: float, cold_usage: float | None = None, hits: int = 5) -> dict:
    lanes = {"hot": [{"running": 2, "waiting": 0, "kv_cache_usage": hot_usage, "kv_capacity_tokens": 90_000,
                      "prefix_cache_queries": 10, "prefix_cache_hits": hits, "served_by_class": {"realtime": 1}}]}
    if cold_usage is not None:
        lanes["cold"] = [{"running": 256, "waiting": 200, "kv_cache_usage": cold_usage, "kv_capacity_tokens": 600_000,
                          "prefix_cache_queries": 0, "prefix_cache_hits": 0}]
    return {"lanes": lanes, "prefix_cache": {}}


def test_lanes_answering_needs_every_listed_lane_with_a_sized_kv_cache():
    assert gc.lanes_answering(_stats(0.1, 0.2))
    assert not gc.lanes_answering({"lanes": {"hot": [{"kv_capacity_tokens": 1}], "cold": [{"error": "timeout"}]}})
    assert not gc.lanes_answering({"lanes": {"hot": [{"kv_capacity_tokens": None}]}})
    assert not gc.lanes_answering({"lanes": {}}) and not gc.lanes_answering("oops")


def test_kv_and_prefix_take_peaks_over_samples_and_rates_from_the_final_snapshot():
    samples = [{"stats": _stats(0.1, 0.5)}, {"stats": _stats(0.3, 0.9)}, {"stats": {"error": "x"}}]
    lanes = gc.kv_and_prefix(samples, _stats(0.0, 0.0, hits=8))
    assert lanes["hot"]["peak_kv_usage"] == 0.3 and lanes["cold"]["peak_kv_usage"] == 0.9
    assert lanes["cold"]["peak_waiting"] == 200
    assert lanes["hot"]["prefix_cache_hit_rate"] == 0.8 and lanes["cold"]["prefix_cache_hit_rate"] is None
    assert lanes["hot"]["kv_capacity_tokens"] == 90_000


def _counters(t: float, hot: dict[str, tuple[int, int]], cold: tuple[int, int] = (0, 0)) -> dict:
    return {"t": t, "stats": {"lanes": {
        "hot": [{"replica_id": rid, "prefix_cache_queries": q, "prefix_cache_hits": h} for rid, (q, h) in hot.items()],
        "cold": [{"replica_id": "c", "prefix_cache_queries": cold[0], "prefix_cache_hits": cold[1]}]}}}


def test_prefix_hit_rate_per_scenario_counts_only_the_counters_growth_inside_its_run():
    # gpu_mixed (no shared prefixes) ran first, 1000 queries and no hits; the shared-prefix scenario then ran from
    # t = 100 to t = 150. Its rate is the growth between the samples bracketing it, not the phase's running total.
    samples = [_counters(90, {"a": (1000, 0), "b": (10, 0)}, (5000, 0)),
               _counters(101, {"a": (1100, 20), "b": (10, 0)}, (5100, 50)),
               _counters(151, {"a": (2000, 600), "b": (110, 100)}, (9000, 3200)),
               {"t": 152, "stats": {"error": "timeout"}}]
    rates = gc.prefix_hit_rate_in_window(samples, 100, 150)
    assert rates["hot"] == pytest.approx(700 / 1100) and rates["cold"] == pytest.approx(3200 / 4000)
    # A replica whose counters went back (restarted) or that a bracketing sample lacks is left out.
    restarted = samples[:1] + [_counters(151, {"a": (500, 400), "b": (110, 100)}, (9000, 3200))]
    assert gc.prefix_hit_rate_in_window(restarted, 100, 150)["hot"] == 1.0
    no_queries = [_counters(90, {"a": (5, 0)}), _counters(151, {"a": (5, 0)})]
    assert gc.prefix_hit_rate_in_window(no_queries, 100, 150)["hot"] is None
    # No sample before the start (or after the end): unknown rather than the phase total.
    assert gc.prefix_hit_rate_in_window(samples[1:], 100, 150) == {}
    assert gc.prefix_hit_rate_in_window(samples, 100, 160) == {}
    # The sampler stops with the phase's last scenario: the final snapshot then closes its window.
    final = _counters(0, {"a": (2000, 600), "b": (110, 100)}, (9000, 3200))["stats"]
    assert gc.prefix_hit_rate_in_window(samples, 100, 160, final)["cold"] == pytest.approx(3200 / 4000)
    phase = {"label": "lanes", "scenarios": {"gpu_shared_prefix": {"prefix_hit_rate_by_lane": {
        "hot": rates["hot"], "cold": None}}}}
    markdown = gc.render_summary_md({"generated_at": "now", "deferred": [], "scenarios": [], "phases": [phase]})
    assert "| lanes | gpu_shared_prefix | hot | 63.6 % |" in markdown
    assert "| lanes | gpu_shared_prefix | cold | – |" in markdown


def test_replica_routing_shows_how_many_lookups_answered_in_time():
    final = {"router": {"replica_routing": {"HotLane": {
        "p50_ms": 5.2, "p99_ms": 9.8, "reasons": {"affinity": 312, "lookup_failed": 703},
        "lookups": {"ok": 346, "timeout": 703}}}}}
    rows = gc.replica_routing(final)
    assert rows["HotLane"]["lookups_ok_share"] == pytest.approx(346 / 1049)
    assert gc.replica_routing({"error": "x"}) == {} and gc.replica_routing(None) == {}
    markdown = gc.render_summary_md({"generated_at": "now", "deferred": [], "scenarios": [],
                                     "phases": [{"label": "affinity", "scenarios": {}, "replica_routing": rows}]})
    assert ("| affinity | HotLane | 5.20 / 9.80 | ok 346, timeout 703 | 33 % | affinity 312, lookup_failed 703 | – |"
            in markdown)


def test_the_summary_shows_the_realtime_reserve_and_who_served_what():
    # Round 10's first reserve phase: the reserved hot replica took the realtime requests, the other the interactive.
    final = {"router": {"replica_routing": {"HotLane": {"p50_ms": 0.07, "p99_ms": 2.3, "reasons": {"short_prompt": 155},
                                                        "reserve_routing": {"preferred": 155}}}},
             "lanes": {"hot": [{"replica_id": "SERVE_REPLICA::llm-lanes#HotLane#oo1ke7nu",
                                "served_by_class": {"interactive": 415}},
                               {"replica_id": "SERVE_REPLICA::llm-lanes#HotLane#jjhawuxv",
                                "served_by_class": {"interactive": 1, "realtime": 135}}]}}
    phase = {"label": "reserve", "scenarios": {}, "replica_routing": gc.replica_routing(final),
             "lanes": gc.kv_and_prefix([], final)}
    markdown = gc.render_summary_md({"generated_at": "now", "deferred": [], "scenarios": [], "phases": [phase]})
    assert "| reserve | HotLane | 0.07 / 2.30 | – | – | short_prompt 155 | preferred 155 |" in markdown
    assert "| reserve | hot | jjhawuxv | interactive 1, realtime 135 |" in markdown
    assert "| reserve | hot | oo1ke7nu | interactive 415 |" in markdown
    assert phase["lanes"]["hot"]["served_by_class"] == {"interactive": 416, "realtime": 135}  # the lane's total


def test_gpu_csv_skips_bad_rows(tmp_path):
    path = tmp_path / "gpu.csv"
    path.write_text("2025/01/01 00:00:00.000, 1000, 143771, 0, 80.5, 345\n"
                    "2025/01/01 00:00:01.000, 120000, 143771, 100, 650.0, 1980\n"
                    "2025/01/01 00:00:02.000, [N/A], 143771, 50, 1, 1\n2025/01/01 00:0")
    gpu = gc.read_gpu_csv(path)
    assert gpu["samples"] == 2 and gpu["memory_used_mib_max"] == 120000 and gpu["utilization_mean"] == 50
    assert gpu["utilization_mean_when_busy"] == 100 and gc.read_gpu_csv(tmp_path / "none.csv") == {}


def _phase(label: str, interactive_p99: float, realtime_p99: float, batch_tps: float) -> dict:
    def row(p99, tps=None):
        return {"ttft_ms": {"p50": p99 / 2, "p90": p99 * 0.9, "p99": p99}, "tpot_ms": {"p50": 5.0},
                "output_tokens_per_s": tps, "errors": {}}

    return {"label": label, "scenarios": {"gpu_mixed": {
        "slo": {"interactive": {"ttft_ms": 100}, "realtime": {"ttft_ms": 50}}, "errors_total": 0,
        "classes": {"interactive": row(interactive_p99), "realtime": row(realtime_p99),
                    "batch": row(30_000, batch_tps)}}}}


def test_targets_are_issue_7s_three_conditions_against_the_fcfs_baseline():
    phases = [_phase("lanes-tuned", 80, 40, 3300), _phase("lanes", 90, 60, 2800),
              _phase("baseline-fcfs", 30_000, 28_000, 3400), _phase("baseline-priority", 700, 500, 3350)]
    gc.evaluate_targets(phases, "gpu_mixed")
    tuned, lanes, fcfs = (p["targets"]["gpu_mixed"] for p in phases[:3])
    assert tuned["all_met"] is True and tuned["batch_vs_fcfs"]["value"] == pytest.approx(3300 / 3400)
    assert lanes["realtime_ttft_p99_ms"]["met"] is False and lanes["batch_vs_fcfs"]["met"] is False
    assert lanes["all_met"] is False
    assert fcfs["batch_vs_fcfs"]["value"] == 1.0 and fcfs["interactive_ttft_p99_ms"]["met"] is False
    markdown = gc.render_summary_md({"generated_at": "now", "deferred": ["baseline-priority"],
                                     "scenarios": ["gpu_mixed"], "phases": phases})
    assert "Deferred" in markdown and "| lanes-tuned | 40.0 / 72.0 / 80.0 | 20.0 / 36.0 / 40.0 |" in markdown
    assert "0.971" in markdown and "**no**" in markdown


def test_direct_ingress_phases_still_compare_with_their_fcfs_baseline():
    # DIRECT_INGRESS=1 names every phase <phase>-di, the FCFS baseline too (2026-12-03: the ratio column was empty).
    phases = [_phase("gpu-lanes-mps-priority-cap85-mps-di", 80, 40, 2720),
              _phase("baseline-fcfs-di", 30_000, 28_000, 3400)]
    gc.evaluate_targets(phases, "gpu_mixed")
    assert phases[0]["targets"]["gpu_mixed"]["batch_vs_fcfs"]["value"] == pytest.approx(0.8)
    assert gc.phase_name("baseline-fcfs-di") == "baseline-fcfs" and gc.is_baseline("baseline-priority-di")
    assert gc.phase_name("baseline-fcfs-di-run2") == "baseline-fcfs" and gc.phase_name("lanes-run12") == "lanes"
    assert not gc.is_baseline("gpu-lanes-mps-priority-cap85-mps-di")


def test_the_batch_ratio_is_against_the_mean_of_the_campaigns_fcfs_runs():
    phases = [_phase("lanes", 80, 40, 3000), _phase("baseline-fcfs", 30_000, 28_000, 3400),
              _phase("baseline-fcfs-run2", 30_000, 28_000, 2600)]
    gc.evaluate_targets(phases, "gpu_mixed")
    assert phases[0]["targets"]["gpu_mixed"]["batch_vs_fcfs"]["value"] == pytest.approx(1.0)


def test_targets_unknown_without_a_baseline():
    phases = [_phase("lanes-tuned", 80, 40, 3300)]
    gc.evaluate_targets(phases, "gpu_mixed")
    assert phases[0]["targets"]["gpu_mixed"]["batch_vs_fcfs"]["met"] is None
    assert phases[0]["targets"]["gpu_mixed"]["all_met"] is None


def test_kv_predictions_read_kv_budget_json_per_config_and_lane(tmp_path):
    (tmp_path / "kv-gpu-lanes-tuned-hot.json").write_text(json.dumps({"tokens_capacity": 91_104}))
    (tmp_path / "kv-gpu-lanes-tuned-cold.json").write_text(json.dumps({"tokens_capacity": 666_176}))
    (tmp_path / "kv-baseline-gpu-hot.json").write_text("kv_budget: broken")
    assert gc.kv_predictions_from(tmp_path) == {"gpu-lanes-tuned": {"hot": 91_104, "cold": 666_176}}


# --------------------------------------------------------------------------------------------------------------------
# the shell script end to end, with stand-ins
# --------------------------------------------------------------------------------------------------------------------


class FakeApp(BaseHTTPRequestHandler):
    """The app's HTTP surface as the campaign uses it. Tokens stream as chunks without text (the dummy model)."""

    def log_message(self, *args):  # quiet
        pass

    def _json(self, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": MODEL}]})
        elif self.path == "/v1/admin/stats":
            self._json(_stats(0.2, 0.6))
        else:
            self.send_error(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        lane = "cold" if body.get("service_tier") == "flex" else "hot"
        headers = {"x-llm-lanes-lane": lane}
        n = body["max_tokens"]
        usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
        if not body.get("stream"):
            time.sleep(0.01)
            self._json({"choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                                     "finish_reason": "length"}], "usage": usage}, headers)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        events = [_chat_chunk({"role": "assistant", "content": ""})]
        events += [_chat_chunk({}, "length" if i == n - 1 else None) for i in range(n)]
        events += [{"choices": [], "usage": usage}, "[DONE]"]
        for event in events:
            self.wfile.write(_sse(event))
            self.wfile.flush()
            time.sleep(0.001)


def serve_fake(port: int) -> None:
    ThreadingHTTPServer(("127.0.0.1", port), FakeApp).serve_forever()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAKE_SERVE = """#!/usr/bin/env bash
echo "serve $*" >> "$FAKE_CALLS"
case "$1" in
  run) exec {python} -c "from tests.unit.test_gpu_campaign import serve_fake; serve_fake($FAKE_PORT)" ;;
  shutdown) [ -f "$FAKE_PID_FILE" ] && kill "$(cat "$FAKE_PID_FILE")" 2>/dev/null; exit 0 ;;
esac
"""
FAKE_RAY = """#!/usr/bin/env bash
echo "ray $*" >> "$FAKE_CALLS"
"""
FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
case "$*" in
  *-lms*) while true; do echo "2025/01/01 00:00:00.000, 120000, 143771, 97, 650.0, 1980"; sleep 0.2; done ;;
  *query-gpu=memory.used*) echo 500 ;;
  *query-compute-apps*) ;;
  *) echo "fake nvidia-smi" ;;
esac
"""

SMALL_SCENARIO = {
    "name": "gpu_mixed", "model": MODEL, "seed": 1, "request_timeout_s": 30, "warmup_requests": 3,
    "count_empty_chunks": True,
    "slo": {"interactive": {"ttft_ms": 1000}, "realtime": {"ttft_ms": 1000}},
    "tally_headers": ["x-llm-lanes-lane"],
    "streams": [
        {"name": "batch", "request_class": "batch", "arrival": {"type": "burst", "n": 6}, "prompt_tokens": 20,
         "max_tokens": 8, "stream": False, "ignore_eos": True},
        {"name": "chat", "request_class": "interactive", "arrival": {"type": "poisson", "rate": 20},
         "duration_s": 0.5, "prompt_tokens": 10, "max_tokens": 6, "ignore_eos": True},
        {"name": "rt", "request_class": "realtime", "arrival": {"type": "poisson", "rate": 10}, "duration_s": 0.5,
         "prompt_tokens": 10, "max_tokens": 4, "ignore_eos": True},
    ],
}


@pytest.fixture
def fake_host(tmp_path):
    """PATH with stand-ins for ray / serve / nvidia-smi, a scenario folder, a model dir; returns the environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("serve", FAKE_SERVE.format(python=sys.executable)), ("ray", FAKE_RAY),
                       ("nvidia-smi", FAKE_NVIDIA_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (scenarios / "gpu_mixed.yaml").write_text(yaml.safe_dump(SMALL_SCENARIO))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    port = _free_port()
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PY": sys.executable, "CAMPAIGN_DIR": str(tmp_path / "campaign"), "OUT": str(tmp_path / "out"),
           "URL": f"http://127.0.0.1:{port}", "FAKE_PORT": str(port), "FAKE_CALLS": str(tmp_path / "calls.txt"),
           "FAKE_PID_FILE": str(tmp_path / "fake.pid"), "SCENARIO_DIR": str(scenarios), "MODEL_DIR": str(model),
           "READY_TIMEOUT_S": "60", "PHASE_EST_S": "20", "PYTHONPATH": str(REPO)}
    return env


def _run(env: dict, *phases: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *phases], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_unknown_phase_is_refused_before_anything_starts(fake_host):
    done = _run(fake_host, "lanes-tuned", "bogus")
    assert done.returncode == 2 and "unknown phase: bogus" in done.stderr
    assert not Path(fake_host["FAKE_CALLS"]).exists()


def test_campaign_runs_two_configs_and_returns_at_most_seven_flat_files(fake_host):
    done = _run(fake_host, "lanes-tuned", "baseline-fcfs")
    assert done.returncode == 0, done.stderr[-3000:]
    campaign, out = Path(fake_host["CAMPAIGN_DIR"]), Path(fake_host["OUT"])
    calls = Path(fake_host["FAKE_CALLS"]).read_text().splitlines()
    # An overlay is served from its merged copy in the phase's folder; a shipped config from its own path.
    assert calls.count(f"serve run --address auto {campaign}/lanes-tuned/serve-config-gpu-lanes-tuned.yaml") == 1
    assert calls.count("serve run --address auto serve_configs/baseline-gpu.yaml") == 1
    assert sum(c.startswith("ray start --head") for c in calls) == 2 and calls.count("ray stop --force") == 4
    for label in ("lanes-tuned", "baseline-fcfs"):
        phase = json.loads((campaign / label / "phase.json").read_text())
        assert phase["status"] == "ok" and phase["timings"]["ready_s"] is not None
        assert json.loads((campaign / label / "smoke.json").read_text())["ok"]
        assert (campaign / label / "gpu_mixed" / "report.json").exists()
    files = sorted(p.name for p in out.iterdir())
    assert all(p.is_file() for p in out.iterdir()) and len(files) <= 7
    assert {"summary.md", "summary.json", "campaign.tar.gz", "campaign.log", "report.md", "latency_cdf.png",
            "throughput.png"} == set(files)
    summary = json.loads((out / "summary.json").read_text())
    by_label = {p["label"]: p for p in summary["phases"]}
    tuned = by_label["lanes-tuned"]["scenarios"]["gpu_mixed"]
    # The fake streams no text at all: only count_empty_chunks gives the streamed classes a TTFT.
    assert tuned["classes"]["interactive"]["ttft_ms"]["p50"] is not None
    assert by_label["lanes-tuned"]["targets"]["gpu_mixed"]["batch_vs_fcfs"]["value"] is not None
    assert by_label["lanes-tuned"]["lanes"]["cold"]["peak_kv_usage"] == 0.6
    assert "Ratios: lanes-tuned ÷ baseline-fcfs" in (out / "report.md").read_text()
    assert (out / "report.md").read_text().count("Ratios: lanes-tuned ÷ baseline-fcfs") == 1
    with tarfile.open(out / "campaign.tar.gz") as tar:
        names = tar.getnames()
    assert "campaign/lanes-tuned/gpu_mixed/report.json" in names and "campaign/combined/summary.md" in names


def test_a_phase_run_again_keeps_the_first_run_and_every_scenarios_report_comes_back_in_the_one_report_file(
        fake_host):
    assert _run(fake_host, "baseline-fcfs").returncode == 0
    scenarios = Path(fake_host["SCENARIO_DIR"])
    (scenarios / "gpu_other.yaml").write_text(yaml.safe_dump({**SMALL_SCENARIO, "name": "gpu_other", "seed": 2}))
    done = _run({**fake_host, "SCENARIOS": "gpu_other gpu_mixed"}, "baseline-fcfs")
    assert done.returncode == 0, done.stderr[-3000:]
    campaign, out = Path(fake_host["CAMPAIGN_DIR"]), Path(fake_host["OUT"])
    for label in ("baseline-fcfs", "baseline-fcfs-run2"):
        assert json.loads((campaign / label / "phase.json").read_text())["label"] == label
        assert (campaign / label / "gpu_mixed" / "report.json").exists()
    assert (campaign / "baseline-fcfs-run2" / "gpu_other" / "report.json").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert {"baseline-fcfs", "baseline-fcfs-run2"} <= {p["label"] for p in summary["phases"]}
    report = (out / "report.md").read_text()
    combined = campaign / "combined"
    mixed, other = ((combined / name / "report.md").read_text() for name in ("gpu_mixed", "gpu_other"))
    assert report.index(mixed) < report.index(other) and len(list(out.iterdir())) <= 8


def test_phases_that_do_not_fit_the_call_are_deferred(fake_host):
    env = {**fake_host, "CALL_BUDGET_S": "45", "PHASE_EST_S": "40"}
    done = _run(env, "baseline-fcfs", "baseline-priority")
    assert done.returncode == 3, done.stderr[-2000:]
    assert "deferred" in done.stderr
    summary = json.loads((Path(env["OUT"]) / "summary.json").read_text())
    assert summary["deferred"] == ["baseline-fcfs", "baseline-priority"] and summary["phases"] == []
    assert not Path(env["FAKE_CALLS"]).exists()  # nothing was started


def test_missing_payload_stops_at_once(fake_host):
    env = {**fake_host, "PATH": "/usr/bin:/bin"}  # no serve / ray (PY is the venv's python, by full path)
    done = _run(env, "baseline-fcfs")
    assert done.returncode == 42 and "payload" in done.stderr


def test_traced_config_sends_every_span_to_the_phase_file():
    text = (REPO / "serve_configs" / "gpu-single.yaml").read_text()
    traced = yaml.safe_load(gc.traced_serve_config(text, "/tmp/campaign/x/spans.jsonl"))
    args = traced["applications"][0]["args"]
    assert args["observability"]["tracing"] == {"exporter": "file", "file_path": "/tmp/campaign/x/spans.jsonl",
                                                "sample_ratio": 1.0}
    original = yaml.safe_load(text)["applications"][0]["args"]
    assert {k: v for k, v in args.items() if k != "observability"} == original  # nothing else changes


def test_a_traced_phase_serves_the_traced_copy_and_writes_a_breakdown(fake_host):
    done = _run({**fake_host, "TRACING": "1"}, "baseline-fcfs")
    assert done.returncode == 0, done.stderr[-3000:]
    phase_dir = Path(fake_host["CAMPAIGN_DIR"]) / "baseline-fcfs-traced"
    traced = phase_dir / "serve-config-traced.yaml"
    calls = Path(fake_host["FAKE_CALLS"]).read_text().splitlines()
    assert f"serve run --address auto {traced}" in calls
    tracing = yaml.safe_load(traced.read_text())["applications"][0]["args"]["observability"]["tracing"]
    assert tracing["file_path"] == str(phase_dir / "spans.jsonl")
    # The fake app writes no spans: the breakdown says so instead of inventing numbers.
    assert "no span file" in (phase_dir / "ttft-breakdown.md").read_text()
    assert "TTFT by hop" in done.stderr

"""LoRA adapters under Zipf traffic: how often a request finds its adapter loaded, and what adapters cost.

Eight tiny adapters of the base model (app.tools.make_tiny_lora, seeds 1-8) on two cold-lane replicas whose engines
mix 4 adapters in a step and hold 4 each in host memory (load_tests/configs/lora-routing.yaml; its variants
lora-routing-max-loras-2.yaml and lora-routing-cache-2.yaml: 2 in a step, and 2 in a step and in memory). For each routing the app is started
fresh (its own batch store, so no adapter is known), the adapters are loaded through POST /v1/load_lora_adapter
(each timed), then flex requests (the cold lane) arrive at a Poisson rate for a fixed time, each naming an adapter
drawn from a Zipf law (s = 1.1, adapter 1 the most popular), and then the same arrivals name the base model. Every
cold replica counts, per request naming an adapter, whether the adapter was in its engine's host-memory cache
(app/lanes/adapter_residency.py; GET /v1/admin/stats, lanes.cold[].adapter_residency).

Routings: "adapter-aware" (prefix_cache.routing: affinity, the lanes' request router narrowing by adapter,
app/prefix_cache/adapter_affinity.py) and "default" (prefix_cache.routing: pow2, the lanes' LaneRouter: Ray Serve's
PowerOfTwoChoicesRequestRouter, the router Serve uses by default, plus a report of the replicas it sees). The prompts
are shorter than prefix_cache.min_prefix_tokens, so the affinity router's own choice among its candidates is the same
power-of-two choice: the two runs differ only in the adapter narrowing.

    .venv/bin/python -m load_tests.lora_routing --out load_tests/results/lora-routing
    .venv/bin/python -m load_tests.lora_routing --dry-run --out /tmp/lora-routing   # configs and plan, no Ray

Outputs in --out: report.json (settings, plan, per run: load times, found-loaded counts, both phases' summaries and
every request's record), report.md, adapters/, and per routing the served config and its serve.log.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml

from app.lanes.replica_stats import ADAPTER_RESIDENCY_STAT
from load_tests.client import RequestRecord, RequestSpec, send, words
from load_tests.overlay import llm_lanes_application, load_serve_config
from load_tests.stats import ratio, summarize_class
from load_tests.workload import REQUESTS_PER_CLIENT, ClientPool

OVERLAY = "load_tests/configs/lora-routing.yaml"
ADAPTER_COUNT = 8
ZIPF_S = 1.1
ROUTINGS = {"adapter-aware": "affinity", "default": "pow2"}
TALLY_HEADERS = ["x-llm-lanes-lane"]
WARMUP_REQUESTS = 4
REQUEST_TIMEOUT_S = 300.0
# How long to wait for every cold replica's stats to count the phase's requests (they report every few seconds).
STATS_WAIT_S = 20.0
TARGETS = {"found_loaded_share": 0.9, "ttft_p99_vs_base": 1.2}


def zipf_weights(count: int, s: float) -> list[float]:
    """P(rank k) = k^-s / sum_j j^-s, for ranks 1..count."""
    raw = [k ** -s for k in range(1, count + 1)]
    return [w / sum(raw) for w in raw]


def arrival_plan(rate: float, duration_s: float, names: list[str], s: float, seed: int) -> list[tuple[float, str]]:
    """(arrival time, adapter) of a Poisson process at `rate` per second for `duration_s`, each arrival naming
    names[k] with Zipf probability (names[0] the most popular). The same seed gives the same plan."""
    rng = random.Random(f"lora-routing:{seed}")
    cumulative = list(itertools.accumulate(zipf_weights(len(names), s)))
    plan, at = [], rng.expovariate(rate)
    while at < duration_s:
        plan.append((at, rng.choices(names, cum_weights=cumulative)[0]))
        at += rng.expovariate(rate)
    return plan


def adapter_names(count: int = ADAPTER_COUNT) -> list[str]:
    return [f"lora-{k}" for k in range(1, count + 1)]


def served_config(config: str, routing: str, run_dir: Path) -> dict[str, Any]:
    """The serve config of one run: the overlay with the routing set and a batch store of the run's own (where
    adapters loaded at run time are kept: a fresh one knows none)."""
    store = (run_dir / "batches.sqlite3").resolve()
    return load_serve_config(config, [f"args.prefix_cache.routing={ROUTINGS[routing]}", f"args.batch.store={store}"])


def make_adapters(base_model: Path, folder: Path) -> dict[str, str]:
    """Adapter name -> folder, each written by make_tiny_lora with its rank as seed (the same files every run)."""
    from app.tools.make_tiny_lora import make_tiny_lora

    if not (base_model / "config.json").exists():
        raise SystemExit(f"no model in {base_model}: run `python -m app.tools.make_tiny_model {base_model}` first")
    adapters = {}
    for seed, name in enumerate(adapter_names(), start=1):
        make_tiny_lora(base_model, folder / name, seed=seed)
        adapters[name] = str((folder / name).resolve())
    return adapters


def residency_by_replica(admin_stats: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {entry["replica_id"]: entry[ADAPTER_RESIDENCY_STAT] for entry in admin_stats["lanes"].get("cold", [])
            if ADAPTER_RESIDENCY_STAT in entry}


def residency_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Requests naming an adapter between two readings that found it loaded / had to load it, over the replicas."""
    by_replica = {replica: {key: counts[key] - before.get(replica, {}).get(key, 0)
                            for key in ("found_loaded", "had_to_load")} for replica, counts in after.items()}
    found = sum(c["found_loaded"] for c in by_replica.values())
    loaded = sum(c["had_to_load"] for c in by_replica.values())
    return {"found_loaded": found, "had_to_load": loaded,
            "share": round(found / (found + loaded), 4) if found + loaded else None, "by_replica": by_replica}


def request_spec(index: int, model: str, seed: int, prompt_tokens: int, max_tokens: int) -> RequestSpec:
    # A request number first: no two prompts share a prefix block.
    prompt = f"request {index} " + words(random.Random(f"{seed}:{index}"), max(1, prompt_tokens - 2))
    return RequestSpec(model, "batch", index, "chat", True, {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "stream": True, "stream_options": {"include_usage": True}, "service_tier": "flex", "ignore_eos": True,
        "temperature": 0})


async def send_plan(url: str, plan: list[tuple[float, str]], rate: float, seed: int, prompt_tokens: int,
                    max_tokens: int) -> list[RequestRecord]:
    """Each arrival at its time (open loop), streamed; one record per request, in plan order."""
    clients = max(1, math.ceil(rate / REQUESTS_PER_CLIENT))
    async with ClientPool(url, clients_per_server=clients, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0),
                          limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024)) as pool:
        run_start = time.perf_counter()

        async def one(index: int, at: float, model: str) -> RequestRecord:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - run_start)))
            return await send(pool.next(), request_spec(index, model, seed, prompt_tokens, max_tokens), run_start,
                              TALLY_HEADERS, REQUEST_TIMEOUT_S, scheduled_s=at)

        return list(await asyncio.gather(*(one(i, at, model) for i, (at, model) in enumerate(plan))))


def phase_summary(records: list[RequestRecord]) -> dict[str, Any]:
    summary = summarize_class(records, None, TALLY_HEADERS)
    summary["requests_by_model"] = dict(sorted(Counter(r.stream for r in records).items()))
    return summary


def measure(url: str, base_model: str, adapters: dict[str, str], plan: list[tuple[float, str]],
            options: dict[str, Any]) -> dict[str, Any]:
    """One started app: load the adapters, warm up, the adapter phase, then the same arrivals on the base model."""
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        load_s = {}
        for name, path in adapters.items():
            started = time.perf_counter()
            answer = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            if answer.status_code != 200:
                raise RuntimeError(f"loading {name} was answered {answer.status_code}: {answer.text[:300]}")
            load_s[name] = round(time.perf_counter() - started, 3)
        # The engines past their first steps before anything is timed; base-model requests, so no adapter is counted.
        warmup = [(0.0, base_model)] * WARMUP_REQUESTS
        asyncio.run(send_plan(url, warmup, 1.0, -1, options["prompt_tokens"], 4))
        before = residency_by_replica(client.get("/v1/admin/stats").json())
        records = asyncio.run(send_plan(url, plan, **options))
        sent = sum(r.ok for r in records)
        deadline = time.monotonic() + STATS_WAIT_S
        while True:  # until every cold replica's stats count the phase's requests
            admin_stats = client.get("/v1/admin/stats").json()
            residency = residency_delta(before, residency_by_replica(admin_stats))
            if residency["found_loaded"] + residency["had_to_load"] >= sent or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        base_records = asyncio.run(send_plan(url, [(at, base_model) for at, _ in plan], **options))
    adapter_phase, base_phase = phase_summary(records), phase_summary(base_records)
    return {
        "adapter_load_s": load_s, "residency": residency,
        "adapter_routing": (admin_stats["router"].get("replica_routing") or {}).get("ColdLane", {})
        .get("adapter_routing"),
        "adapters": adapter_phase, "base": base_phase,
        "vs_base": {"ttft_p50": ratio(adapter_phase["ttft_ms"]["p50"], base_phase["ttft_ms"]["p50"]),
                    "ttft_p99": ratio(adapter_phase["ttft_ms"]["p99"], base_phase["ttft_ms"]["p99"]),
                    "output_tokens_per_s": ratio(adapter_phase["output_tokens_per_s"],
                                                 base_phase["output_tokens_per_s"])},
        "records": {"adapters": [r.to_json() for r in records], "base": [r.to_json() for r in base_records]},
    }


def plan_summary(plan: list[tuple[float, str]], names: list[str], slots: int) -> dict[str, Any]:
    weights = zipf_weights(len(names), ZIPF_S)
    return {"requests": len(plan), "zipf_s": ZIPF_S,
            "by_adapter": dict(sorted(Counter(name for _, name in plan).items())),
            "zipf_shares": {name: round(w, 4) for name, w in zip(names, weights)},
            # With arrivals drawn independently, no cache of `slots` adapters in all finds more than the most popular
            # `slots` adapters' share on average.
            "host_memory_slots": slots, "share_of_the_most_popular_that_fit": round(sum(weights[:slots]), 4)}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def render_markdown(report: dict[str, Any]) -> str:
    s, plan = report["settings"], report["plan"]
    lines = [f"# LoRA routing: {ADAPTER_COUNT} adapters, Zipf s={plan['zipf_s']}, two cold replicas", "",
             f"Flex chat requests (cold lane) at Poisson {s['rate']}/s for {s['duration_s']} s ({plan['requests']} "
             f"requests, seed {s['seed']}, ~{s['prompt_tokens']} prompt tokens, {s['max_tokens']} output tokens), "
             f"naming an adapter, then the same arrivals on the base model. The {plan['host_memory_slots']} "
             f"most popular adapters (as many as the replicas hold in host memory in all) draw "
             f"{plan['share_of_the_most_popular_that_fit']:.0%} of the requests.", "",
             "| routing | found loaded | TTFT p50 / p99 ms (adapters) | TTFT p50 / p99 ms (base) | TTFT p99 ÷ base "
             "| tokens/s ÷ base | adapter load s (median / max) | errors (adapters, base) |",
             "|---|---|---|---|---|---|---|---|"]
    for label, run in report["runs"].items():
        if "error" in run:
            lines.append(f"| {label} | failed: {run['error'][:200]} |||||||")
            continue
        a, b, loads = run["adapters"], run["base"], sorted(run["adapter_load_s"].values())
        r = run["residency"]
        lines.append(
            f"| {label} | {_fmt(r['share'] and r['share'] * 100)} % ({r['found_loaded']} / "
            f"{r['found_loaded'] + r['had_to_load']}) | {_fmt(a['ttft_ms']['p50'])} / {_fmt(a['ttft_ms']['p99'])} | "
            f"{_fmt(b['ttft_ms']['p50'])} / {_fmt(b['ttft_ms']['p99'])} | {_fmt(run['vs_base']['ttft_p99'], 2)} | "
            f"{_fmt(run['vs_base']['output_tokens_per_s'], 2)} | {loads[len(loads) // 2]:.2f} / {loads[-1]:.2f} | "
            f"{a['errors'] or 0}, {b['errors'] or 0} |")
    lines += ["", f"Targets: adapter-aware routing finds ≥ {TARGETS['found_loaded_share']:.0%} of adapters loaded; "
              f"TTFT p99 ≤ {TARGETS['ttft_p99_vs_base']}× the base model's at the same rate.", "",
              "Adapter load time: POST /v1/load_lora_adapter, each adapter in turn: the Router's checks, the store, "
              "and add_lora (read from disk, checked against the model) on one replica of each lane, in parallel.",
              "Found loaded: per cold replica, whether the adapter was in its engine's host-memory LRU cache as the "
              "request reached the engine (app/lanes/adapter_residency.py).", ""]
    for label, run in report["runs"].items():
        if "error" not in run:
            lines.append(f"- {label}: routing reasons {run['adapter_routing']}; by replica "
                         f"{run['residency']['by_replica']}; requests by adapter "
                         f"{run['adapters']['requests_by_model']}")
    return "\n".join(lines) + "\n"


def _log(message: str) -> None:
    print(f"[lora_routing {dt.datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.lora_routing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the report, adapters and served configs")
    parser.add_argument("--serve-config", default=OVERLAY, help="serve config or overlay (default %(default)s)")
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second (default %(default)s)")
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per phase "
                                                                     "(default %(default)s)")
    parser.add_argument("--seed", type=int, default=7, help="arrivals, adapters drawn, prompts (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--dry-run", action="store_true", help="write the served configs and print the plan only")
    args = parser.parse_args(argv)
    out = Path(args.out)
    names = adapter_names()
    plan = arrival_plan(args.rate, args.duration, names, ZIPF_S, args.seed)
    documents = {label: served_config(args.serve_config, label, out / label) for label in ROUTINGS}
    app_args = llm_lanes_application(documents["adapter-aware"])["args"]
    cold = app_args["cold_lane"]
    slots = cold["deployment"]["num_replicas"] * cold["engine"]["lora"]["max_cpu_loras"]
    settings = {"serve_config": args.serve_config, "rate": args.rate, "duration_s": args.duration, "seed": args.seed,
                "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "routings": ROUTINGS}
    report: dict[str, Any] = {"settings": settings, "plan": plan_summary(plan, names, slots), "runs": {}}
    for label, document in documents.items():
        (out / label).mkdir(parents=True, exist_ok=True)
        (out / label / "served-lora-routing.yaml").write_text(yaml.safe_dump(document, sort_keys=False),
                                                              encoding="utf-8")
    if args.dry_run:
        print(json.dumps({**report, "served_configs": {label: str(out / label / "served-lora-routing.yaml")
                                                       for label in ROUTINGS}}, indent=1))
        return 0
    from load_tests.serve_runner import serve_and_run

    adapters = make_adapters(Path(app_args["model"]["source"]), out / "adapters")
    options = {"rate": args.rate, "seed": args.seed, "prompt_tokens": args.prompt_tokens,
               "max_tokens": args.max_tokens}
    for label, document in documents.items():
        (out / label / "batches.sqlite3").unlink(missing_ok=True)  # a fresh store: no adapter loaded yet
        try:
            report["runs"][label] = serve_and_run(
                document, "lora-routing.yaml", out / label, args.ready_timeout,
                lambda url: measure(url, app_args["model"]["served_name"], adapters, plan, options), _log)
        except Exception as error:  # reported in its row; the other routing still runs
            _log(f"{label} failed: {error!r}")
            report["runs"][label] = {"error": str(error) or repr(error)}
    (out / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    markdown = render_markdown(report)
    (out / "report.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    return 0 if all("error" not in run for run in report["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

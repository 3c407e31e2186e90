"""Overload: far more interactive streams than the hot lane runs at once, after a quiet spell. Does the hot lane stay
busy, do admitted interactive requests keep their TTFT within `admission.interactive_ttft_slo_s`, are the others
refused early with 429 and a usable Retry-After, and does flex work keep progressing?

    python -m load_tests.overload --serve-config serve_configs/local.yaml --out load_tests/results/overload
    python -m load_tests.overload --serve-config serve_configs/local.yaml --interactive-x 5 --flex 16 \
        --set model.source=/abs/path/to/tiny-llama --out /tmp/overload

Phases, one after the other on one running app:
  light  Poisson interactive arrivals (`--light-rate` per s for `--light-s`), one client process;
  quiet  nothing sent for `--quiet-s` (the app's estimates age through idle time);
  burst  `--interactive` closed-loop interactive streams and `--flex` closed-loop flex (`service_tier: "flex"`) streams
         for `--burst-s`, split over `--clients` client processes (one asyncio process cannot keep hundreds of
         streams fed on a small host). Requests still in flight when the time is up are awaited.
Every request streams `--max-tokens` output tokens (`ignore_eos`). `/v1/admin/stats` is sampled every
`--sample-interval` s throughout (hot engine running/waiting, the Router's queued interactive requests and, where
the app reports it, `router.hot_slots`).

`python -m load_tests.overload rebuild OUT` recomputes a saved report from its report.json (records, windows,
samples). A refused burst stream waits the refusal's Retry-After (1 s without one) before its next request, as the
OpenAI SDK does before a retry; `--no-wait-on-refusal` sends the next request at once; `--resend-refused-after S`
sends the refused request again, the same, S seconds later whatever its Retry-After (a naive retry loop).

With `--serve-config` alone the app is started (`serve run` of a derived copy of the config: `--set` overrides on the
app's args, the batch store moved under `--out`), measured and stopped; with `--url` too, the app already running
there is measured and the config only supplies the limits the report judges against. Outputs in `--out`:
report.json (settings, per-phase summaries, stats samples, every request's record), report.md, stats.jsonl (the raw
samples), the derived config and the `serve run` log.

The hot lane's capacity is its engines' slots: hot `max_num_seqs` x hot replicas; `--interactive-x 5` sends five
times that many interactive streams. The idle-hot-lane figure counts stats samples taken while the Router held
interactive requests (queued, or waiting for a hot slot) and the hot engines ran fewer sequences than their
`max_num_seqs`. The stats come from whichever Router replica answers, so with several Router replicas it sees that
replica's queue only.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime as dt
import json
import math
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from load_tests.client import RequestRecord
from load_tests.stats import distribution_ms, percentile
from load_tests.workload import split

DEFAULT_URL = "http://127.0.0.1:8000"
LANE_HEADER = "x-llm-lanes-lane"
DEGRADED_HEADER = "x-llm-lanes-degraded"
HOT_SATURATED = "hot_saturated"
REPLAYED_HEADER = "x-llm-lanes-replayed"  # a 429 the HTTP proxy replayed to a retry (app/router/refusal_replay.py)
TALLY_HEADERS = [LANE_HEADER, DEGRADED_HEADER, REPLAYED_HEADER]
CLASSES = ("interactive", "batch")  # batch = flex streams
PHASES = ("light", "quiet", "burst")
STATS_TIMEOUT_S = 10.0
# A refused closed-loop stream waits this long when the refusal named no Retry-After, and never longer than the max.
REFUSAL_WAIT_DEFAULT_S = 1.0
REFUSAL_WAIT_MAX_S = 60.0


# --------------------------------------------------------------------------------------------------------------------
# The config's limits
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What the report judges against, from the app's args (schema defaults filled in)."""

    hot_max_num_seqs: int
    hot_replicas: int
    realtime_max_inflight: int
    router_replicas: int
    interactive_ttft_slo_s: float

    @property
    def hot_capacity(self) -> int:
        """Sequences the hot lane's engines run at once."""
        return self.hot_max_num_seqs * self.hot_replicas

    def to_json(self) -> dict[str, Any]:
        return {"hot_max_num_seqs": self.hot_max_num_seqs, "hot_replicas": self.hot_replicas,
                "realtime_max_inflight": self.realtime_max_inflight, "router_replicas": self.router_replicas,
                "interactive_ttft_slo_s": self.interactive_ttft_slo_s, "hot_capacity": self.hot_capacity}


def limits_from_args(args: dict[str, Any]) -> Limits:
    from app.config import load_app_config

    cfg = load_app_config(args)
    hot = cfg.hot_lane
    return Limits(
        hot_max_num_seqs=hot.engine.max_num_seqs,
        hot_replicas=hot.deployment.min_replicas,
        realtime_max_inflight=cfg.admission.realtime_max_inflight,
        router_replicas=cfg.router.num_replicas,
        interactive_ttft_slo_s=cfg.admission.interactive_ttft_slo_s,
    )


def app_args(document: dict[str, Any]) -> dict[str, Any]:
    from load_tests.serve_runner import llm_lanes_application

    return llm_lanes_application(document).setdefault("args", {})


def parse_override(text: str) -> tuple[list[str], Any]:
    """'model.source=/abs/tiny' -> (['model', 'source'], '/abs/tiny'); the value is YAML ('2.0' is a float)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"expected KEY=VALUE (a dotted path into the app's args), got {text!r}")
    return key.strip().split("."), yaml.safe_load(value)


def apply_overrides(args: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of the app's args with each dotted KEY=VALUE set (missing mappings are created)."""
    result = copy.deepcopy(args)
    for text in overrides:
        path, value = parse_override(text)
        node = result
        for key in path[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            node = child
        node[path[-1]] = value
    return result


def interactive_streams(explicit: int | None, multiple: float | None, capacity: int) -> int:
    """--interactive N, or --interactive-x X times the hot lane's capacity (at least 1)."""
    if explicit is not None and multiple is not None:
        raise ValueError("give --interactive or --interactive-x, not both")
    if multiple is not None:
        return max(1, round(multiple * capacity))
    return explicit if explicit is not None else 160


# --------------------------------------------------------------------------------------------------------------------
# The workload (scenarios for load_tests.workload)
# --------------------------------------------------------------------------------------------------------------------


def _stream(name: str, request_class: str, arrival: dict[str, Any], duration_s: float, max_tokens: int,
            prompt_tokens: dict[str, Any], model: str) -> dict[str, Any]:
    return {"name": name, "request_class": request_class, "arrival": arrival, "duration_s": duration_s,
            "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "stream": True, "endpoint": "chat",
            "model": model, "ignore_eos": True}


def light_scenario(model: str, rate: float, duration_s: float, max_tokens: int, prompt_tokens: dict[str, Any],
                   seed: int, timeout_s: float) -> dict[str, Any]:
    return {"name": "overload-light", "model": model, "seed": seed, "request_timeout_s": timeout_s,
            "tally_headers": TALLY_HEADERS,
            "streams": [_stream("light-interactive", "interactive", {"type": "poisson", "rate": rate}, duration_s,
                                max_tokens, prompt_tokens, model)]}


def burst_scenarios(model: str, interactive: int, flex: int, clients: int, duration_s: float, max_tokens: int,
                    prompt_tokens: dict[str, Any], seed: int, timeout_s: float) -> list[dict[str, Any]]:
    """One scenario per client process; stream names differ per client so every prompt differs."""
    scenarios = []
    for client, (n_interactive, n_flex) in enumerate(zip(split(interactive, clients), split(flex, clients))):
        streams = []
        if n_interactive:
            streams.append(_stream(f"burst-interactive-c{client}", "interactive",
                                   {"type": "closed", "concurrency": n_interactive}, duration_s, max_tokens,
                                   prompt_tokens, model))
        if n_flex:
            streams.append(_stream(f"burst-flex-c{client}", "batch", {"type": "closed", "concurrency": n_flex},
                                   duration_s, max_tokens, prompt_tokens, model))
        if streams:
            scenarios.append({"name": f"overload-burst-c{client}", "model": model, "seed": seed,
                              "request_timeout_s": timeout_s, "tally_headers": TALLY_HEADERS, "streams": streams})
    return scenarios


def refusal_wait_s(record: RequestRecord, default_s: float = REFUSAL_WAIT_DEFAULT_S) -> float | None:
    """How long a closed-loop stream that honours refusals waits before its next request: the Retry-After of a
    refused request (default_s without one, or after an answer that never came), None after a 200."""
    if record.status == 200:
        return None
    delay = retry_after_s(record.retry_after)
    return min(REFUSAL_WAIT_MAX_S, max(0.0, delay)) if delay is not None else default_s


async def run_closed_loop(scenario: Any, base_url: str, wait_on_refusal: bool = True,
                          resend_refused_after_s: float | None = None) -> tuple[list[RequestRecord], float, float]:
    """Every stream of `scenario` (all closed loop) for its duration: (records, unix start, wall seconds).

    Unlike load_tests.workload's closed loop, a stream whose request was refused waits the answer's Retry-After
    before its next request (as the OpenAI SDK does before a retry), unless `wait_on_refusal` is off: streams then
    send the next one at once and the refusals themselves become load. With `resend_refused_after_s`, a refused (429)
    request is sent again, the same body, that many seconds later whatever its Retry-After: a naive retry loop."""
    import httpx

    from load_tests.client import PromptFactory, send
    from load_tests.workload import MAX_CONNECTIONS, REQUESTS_PER_CLIENT, ClientPool, peak_outstanding

    limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS)
    timeout = httpx.Timeout(scenario.request_timeout_s, connect=30.0)
    factory = PromptFactory(scenario)
    clients = max(1, math.ceil(peak_outstanding(scenario) / REQUESTS_PER_CLIENT))
    records: list[RequestRecord] = []
    async with ClientPool(base_url, clients_per_server=clients, limits=limits, timeout=timeout) as pool:
        start_unix, run_start = time.time(), time.perf_counter()

        async def stream_loop(stream: Any) -> None:
            duration = scenario.stream_duration_s(stream)
            issued = 0

            def left() -> float:
                return duration - (time.perf_counter() - run_start)

            async def worker() -> None:
                nonlocal issued
                index = None
                while left() > 0:
                    if index is None:
                        index = issued
                        issued += 1
                    record = await send(pool.next(), factory.request(stream, index), run_start,
                                        scenario.tally_headers, scenario.request_timeout_s)
                    records.append(record)
                    if resend_refused_after_s is not None and record.status == 429:
                        await asyncio.sleep(max(0.0, min(resend_refused_after_s, left())))
                        continue  # the same request again
                    index = None
                    wait = refusal_wait_s(record) if wait_on_refusal else None
                    if wait and left() > 0:
                        await asyncio.sleep(min(wait, left()))

            await asyncio.gather(*(worker() for _ in range(stream.arrival.concurrency)))

        await asyncio.gather(*(stream_loop(stream) for stream in scenario.streams))
        return records, start_unix, time.perf_counter() - run_start


async def drive(scenario_doc: dict[str, Any], url: str, wait_on_refusal: bool = True,
                resend_refused_after_s: float | None = None) -> dict[str, Any]:
    """Run one scenario; {"start_unix": when its run began, "wall_s", "records": [record JSON]}. Closed-loop
    scenarios run in run_closed_loop, others in load_tests.workload."""
    from load_tests.scenario import parse_scenario
    from load_tests.workload import run_scenario

    from load_tests import host

    scenario = parse_scenario(scenario_doc)
    before, began = host.sample(), time.perf_counter()
    if all(stream.arrival.type == "closed" for stream in scenario.streams):
        records, start_unix, wall_s = await run_closed_loop(scenario, url, wait_on_refusal, resend_refused_after_s)
    else:
        records, wall_s = await run_scenario(scenario, url)
        start_unix = time.time() - wall_s
    generator = host.usage(before, host.sample(), time.perf_counter() - began)
    return {"start_unix": start_unix, "wall_s": wall_s, "generator": generator,
            "records": [r.to_json() for r in records]}


def worker_main(argv: list[str]) -> int:
    """`python -m load_tests.overload worker SCENARIO.json URL OUT.json [--no-wait-on-refusal]
    [--resend-refused-after=S]`: one client process."""
    wait_on_refusal = "--no-wait-on-refusal" not in argv
    resend = [float(a.split("=", 1)[1]) for a in argv if a.startswith("--resend-refused-after=")]
    scenario_path, url, out_path = [a for a in argv if not a.startswith("--")]
    scenario_doc = json.loads(Path(scenario_path).read_text(encoding="utf-8"))
    result = asyncio.run(drive(scenario_doc, url, wait_on_refusal, resend[0] if resend else None))
    Path(out_path).write_text(json.dumps(result), encoding="utf-8")
    return 0


def run_clients(scenarios: list[dict[str, Any]], url: str, work_dir: Path, phase: str,
                wait_on_refusal: bool = True, resend_refused_after_s: float | None = None) -> list[dict[str, Any]]:
    """Each scenario in its own client process, all at once; their results in order."""
    work_dir.mkdir(parents=True, exist_ok=True)
    processes = []
    for i, scenario in enumerate(scenarios):
        scenario_path = work_dir / f"{phase}-client{i}-scenario.json"
        out_path = work_dir / f"{phase}-client{i}-records.json"
        scenario_path.write_text(json.dumps(scenario), encoding="utf-8")
        log = open(work_dir / f"{phase}-client{i}.log", "wb")
        process = subprocess.Popen([sys.executable, "-m", "load_tests.overload", "worker", str(scenario_path), url,
                                    str(out_path)] + ([] if wait_on_refusal else ["--no-wait-on-refusal"])
                                   + ([] if resend_refused_after_s is None
                                      else [f"--resend-refused-after={resend_refused_after_s}"]),
                                   stdout=log, stderr=subprocess.STDOUT)
        processes.append((process, out_path, log))
    results = []
    for process, out_path, log in processes:
        code = process.wait()
        log.close()
        if code != 0 or not out_path.exists():
            raise RuntimeError(f"{phase} client exited with {code}; see {log.name}")
        results.append(json.loads(out_path.read_text(encoding="utf-8")))
    return results


# --------------------------------------------------------------------------------------------------------------------
# /v1/admin/stats samples
# --------------------------------------------------------------------------------------------------------------------


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def stats_view(stats: Any) -> dict[str, Any] | None:
    """What the report needs from one /v1/admin/stats answer (None when it is not one): hot engines' running and
    waiting summed over the answering replicas, the Router's queued interactive requests, `router.hot_slots`."""
    if not isinstance(stats, dict) or not isinstance(stats.get("lanes"), dict):
        return None
    entries = stats["lanes"].get("hot") or []
    entries = entries if isinstance(entries, list) else [entries]
    hot = [e for e in entries if isinstance(e, dict) and "error" not in e]
    router = stats.get("router") if isinstance(stats.get("router"), dict) else {}
    queued = router.get("queued_by_class") if isinstance(router.get("queued_by_class"), dict) else {}
    slots = router.get("hot_slots")
    ttft = router.get("ttft_ms") if isinstance(router.get("ttft_ms"), dict) else {}
    return {
        "hot_replicas": len(hot),
        "hot_running": sum(_int(e.get("running")) for e in hot),
        "hot_waiting": sum(_int(e.get("waiting")) for e in hot),
        "queued_interactive": _int(queued.get("interactive")),
        "hot_slots": ({k: _int(slots.get(k)) for k in ("limit", "in_flight", "waiting")}
                      if isinstance(slots, dict) else None),
        # The Router's own TTFT of its recent interactive requests per lane ({"p50_ms", "p99_ms", "count"}).
        "router_ttft_interactive": ttft.get("interactive") if isinstance(ttft.get("interactive"), dict) else None,
    }


def interactive_held(view: dict[str, Any]) -> int:
    """Interactive requests the Router held back in this sample: queued, or waiting for a hot slot."""
    slots = view.get("hot_slots") or {}
    return max(view["queued_interactive"], slots.get("waiting", 0))


def summarize_samples(samples: Sequence[dict[str, Any]], hot_max_num_seqs: int) -> dict[str, Any]:
    """Over samples {"t", "status", "view"}: the idle-hot-lane figure and the hot lane's peaks."""
    views = [s["view"] for s in samples if s.get("view") is not None]
    held = [v for v in views if interactive_held(v) > 0]
    # Below max_num_seqs on every answering replica, summed: the engines had free slots.
    idle = [v for v in held if v["hot_running"] < hot_max_num_seqs * max(1, v["hot_replicas"])]
    slot_views = [v["hot_slots"] for v in views if v.get("hot_slots")]
    # Where the Router reports its hot slots: held back while the hot engines ran fewer than the Router's own
    # interactive share of them (the rest of max_num_seqs is kept for realtime requests).
    below_limit = [v for v in held if v.get("hot_slots") and v["hot_running"] < v["hot_slots"]["limit"]]
    # Requests waiting in the Router for a hot slot (not those on their way to an engine or in their prefill).
    waiting_for_hot = [v for v in views if v.get("hot_slots") and v["hot_slots"]["waiting"] > 0]
    return {
        "samples": len(samples),
        "answered": len(views),
        "with_interactive_held": len(held),
        "held_while_hot_below_max_num_seqs": len(idle),
        "held_while_hot_running_none": sum(1 for v in held if v["hot_running"] == 0),
        "held_while_hot_below_slots_limit": len(below_limit) if slot_views else None,
        "with_waiting_for_hot_slot": len(waiting_for_hot) if slot_views else None,
        "waiting_for_hot_slot_while_hot_running_none": (sum(1 for v in waiting_for_hot if v["hot_running"] == 0)
                                                        if slot_views else None),
        "hot_running_max": max((v["hot_running"] for v in views), default=None),
        "hot_running_mean": (sum(v["hot_running"] for v in views) / len(views)) if views else None,
        "hot_in_engine_max": max((v["hot_running"] + v["hot_waiting"] for v in views), default=None),
        "queued_interactive_max": max((v["queued_interactive"] for v in views), default=None),
        "hot_slots_reported": bool(slot_views),
        "hot_slots_limit": slot_views[-1]["limit"] if slot_views else None,
        "hot_slots_in_flight_max": max((s["in_flight"] for s in slot_views), default=None),
        "hot_slots_waiting_max": max((s["waiting"] for s in slot_views), default=None),
        # The Router's recent interactive TTFT as of the phase's last sample that reports it.
        "router_ttft_interactive": next((v["router_ttft_interactive"] for v in reversed(views)
                                         if v.get("router_ttft_interactive")), None),
    }


class StatsSampler:
    """A thread that reads GET /v1/admin/stats every `interval_s`, tagging each sample with the current phase;
    the raw answers go to `raw_path` (JSON lines) if given."""

    def __init__(self, url: str, interval_s: float, raw_path: Path | None = None):
        self.url = url.rstrip("/")
        self.interval_s = interval_s
        self.raw_path = raw_path
        self.phase = "start"
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-sampler", daemon=True)

    def __enter__(self) -> "StatsSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=STATS_TIMEOUT_S + 5)

    def _run(self) -> None:
        import httpx

        handle = open(self.raw_path, "a", encoding="utf-8") if self.raw_path else None
        try:
            with httpx.Client(timeout=STATS_TIMEOUT_S) as client:
                while not self._stop.is_set():
                    began = time.monotonic()
                    t, phase = time.time(), self.phase
                    try:
                        response = client.get(self.url + "/v1/admin/stats")
                        status, stats = response.status_code, response.json()
                    except (httpx.HTTPError, ValueError) as error:
                        status, stats = None, f"{type(error).__name__}: {error}"
                    view = stats_view(stats) if status == 200 else None
                    self.samples.append({"t": round(t, 3), "phase": phase, "status": status, "view": view})
                    if handle is not None:
                        handle.write(json.dumps({"t": round(t, 3), "phase": phase, "status": status,
                                                 "stats": stats}) + "\n")
                        handle.flush()
                    self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))
        finally:
            if handle is not None:
                handle.close()


# --------------------------------------------------------------------------------------------------------------------
# Aggregation (pure)
# --------------------------------------------------------------------------------------------------------------------


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header's delay in seconds (only the delta-seconds form); None when absent or not a number."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) else None


def degraded_reasons(record: RequestRecord) -> set[str]:
    return {r.strip() for r in record.headers.get(DEGRADED_HEADER, "").split(",") if r.strip()}


def tokens_in_window(record: RequestRecord, start_s: float, end_s: float) -> float:
    """Output tokens of a successful request that arrived in [start_s, end_s) (run-relative times): its usage
    count spread over its content chunks, as load_tests.stats.throughput_series does."""
    if not record.ok or not record.output_tokens:
        return 0.0
    times = [record.start_s + offset for offset in record.chunk_offsets_s]
    if not times:
        end = record.end_s
        return float(record.output_tokens) if end is not None and start_s <= end < end_s else 0.0
    share = record.output_tokens / len(times)
    return share * sum(1 for t in times if start_s <= t < end_s)


def lane_in_flight_mean(records: Sequence[RequestRecord], lane: str, start_s: float, end_s: float) -> float | None:
    """Mean number of admitted requests on `lane` generating over [start_s, end_s): their time inside the window
    from first token to last byte (not the time they waited before it) over the window's length."""
    span = end_s - start_s
    if span <= 0:
        return None
    busy = 0.0
    for r in records:
        if r.status == 200 and r.end_s is not None and r.headers.get(LANE_HEADER) == lane:
            first = r.start_s + (r.ttft_s if r.ttft_s is not None else 0.0)
            busy += max(0.0, min(r.end_s, end_s) - max(first, start_s))
    return busy / span


def summarize_class(records: Sequence[RequestRecord], slo_s: float | None,
                    window: tuple[float, float] | None = None) -> dict[str, Any]:
    """One class in one phase. Admitted = answered 200 (a stream that broke later is admitted and an error).
    `window` (run-relative start, end): completions and tokens/s counted inside it."""
    admitted = [r for r in records if r.status == 200]
    rejected = [r for r in records if r.status == 429]
    retry = [retry_after_s(r.retry_after) for r in rejected]
    retry_values = sorted(v for v in retry if v is not None)
    ttfts = [r.ttft_s for r in admitted if r.ok and r.ttft_s is not None]
    ttft = distribution_ms(ttfts)
    lanes = Counter(r.headers.get(LANE_HEADER, "(absent)") for r in admitted)
    summary: dict[str, Any] = {
        "sent": len(records),
        "admitted": len(admitted),
        "completed": sum(1 for r in admitted if r.ok),
        "rejected_429": len(rejected),
        "retry_after_s": {
            "min": retry_values[0] if retry_values else None,
            "median": percentile(retry_values, 50) if retry_values else None,
            "max": retry_values[-1] if retry_values else None,
            "missing": sum(1 for v in retry if v is None),
        },
        "other_errors": dict(sorted(Counter(r.error_key for r in records
                                            if not r.ok and r.status != 429).items())),
        "server_errors_5xx": sum(1 for r in records if r.status is not None and r.status >= 500),
        "ttft_ms": ttft,
        "ttft_slo_s": slo_s,
        "ttft_within_slo": (sum(1 for t in ttfts if t <= slo_s) / len(ttfts)) if slo_s and ttfts else None,
        "ttft_p99_within_slo": (ttft["p99"] <= slo_s * 1000) if slo_s and ttft["p99"] is not None else None,
        "lanes": dict(sorted(lanes.items())),
        "ttft_ms_by_lane": {lane: distribution_ms(r.ttft_s for r in admitted if r.ok and r.ttft_s is not None
                                                  and r.headers.get(LANE_HEADER) == lane)
                            for lane in sorted(lanes)},
        # The streams the Router holds keep flowing while it refuses others: time per output token once started.
        "tpot_ms": distribution_ms((r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in admitted
                                   if r.ok and r.streaming and r.ttft_s is not None and r.e2e_s is not None
                                   and r.output_tokens > 1),
        "hot_share": (lanes.get("hot", 0) / len(admitted)) if admitted else None,
        "hot_saturated": sum(1 for r in admitted if HOT_SATURATED in degraded_reasons(r)),
        "output_tokens": sum(r.output_tokens for r in admitted if r.ok),
    }
    if window is not None:
        start, end = window
        span = end - start
        in_window = [r for r in admitted if r.ok and r.end_s is not None and start <= r.end_s < end]
        tokens = sum(tokens_in_window(r, start, end) for r in admitted)
        summary["window_s"] = span
        summary["completed_in_window"] = len(in_window)
        summary["tokens_in_window"] = tokens
        summary["tokens_per_s_in_window"] = tokens / span if span > 0 else None
        summary["hot_in_flight_mean"] = lane_in_flight_mean(records, "hot", start, end)
    return summary


def records_from(results: Sequence[dict[str, Any]], origin_unix: float) -> list[RequestRecord]:
    """Client processes' results -> records on one clock: start_s relative to `origin_unix`."""
    records = []
    for result in results:
        shift = result["start_unix"] - origin_unix
        for raw in result["records"]:
            record = RequestRecord(**raw)
            record.start_s += shift
            records.append(record)
    return records


def summarize_phase(name: str, records: Sequence[RequestRecord], slo_s: float | None,
                    window: tuple[float, float] | None, samples: Sequence[dict[str, Any]],
                    hot_max_num_seqs: int) -> dict[str, Any]:
    classes = {c: summarize_class([r for r in records if r.request_class == c], slo_s if c == "interactive" else None,
                                  window)
               for c in CLASSES if any(r.request_class == c for r in records)}
    return {"name": name, "window_s": (window[1] - window[0]) if window else None, "classes": classes,
            "stats": summarize_samples(samples, hot_max_num_seqs)}


def headline(phases: dict[str, dict[str, Any]], limits: Limits) -> dict[str, Any]:
    """The burst's figures the overload behaviour is judged on."""
    burst = phases.get("burst") or {}
    interactive = (burst.get("classes") or {}).get("interactive") or {}
    flex = (burst.get("classes") or {}).get("batch") or {}
    stats = burst.get("stats") or {}
    return {
        "interactive_admitted": interactive.get("admitted"),
        "interactive_429": interactive.get("rejected_429"),
        "interactive_on_hot": (interactive.get("lanes") or {}).get("hot"),
        "interactive_hot_share": interactive.get("hot_share"),
        "interactive_hot_saturated": interactive.get("hot_saturated"),
        "interactive_hot_in_flight_mean": interactive.get("hot_in_flight_mean"),
        "hot_capacity": limits.hot_capacity,
        "interactive_ttft_p50_ms": (interactive.get("ttft_ms") or {}).get("p50"),
        "interactive_ttft_p99_ms": (interactive.get("ttft_ms") or {}).get("p99"),
        "interactive_tpot_p50_ms": (interactive.get("tpot_ms") or {}).get("p50"),
        "interactive_tpot_p99_ms": (interactive.get("tpot_ms") or {}).get("p99"),
        "interactive_ttft_slo_s": limits.interactive_ttft_slo_s,
        "interactive_ttft_p99_within_slo": interactive.get("ttft_p99_within_slo"),
        "retry_after_s": interactive.get("retry_after_s"),
        "server_errors_5xx": sum((c.get("server_errors_5xx") or 0) for c in (burst.get("classes") or {}).values()),
        "flex_completed_in_window": flex.get("completed_in_window"),
        "flex_tokens_per_s_in_window": flex.get("tokens_per_s_in_window"),
        "samples_interactive_held": stats.get("with_interactive_held"),
        "samples_held_while_hot_below_max_num_seqs": stats.get("held_while_hot_below_max_num_seqs"),
        "samples_held_while_hot_running_none": stats.get("held_while_hot_running_none"),
        "samples_held_while_hot_below_slots_limit": stats.get("held_while_hot_below_slots_limit"),
        "hot_in_engine_max": stats.get("hot_in_engine_max"),
        "samples_waiting_for_hot_slot": stats.get("with_waiting_for_hot_slot"),
        "samples_waiting_for_hot_slot_while_hot_running_none": stats.get("waiting_for_hot_slot_while_hot_running_none"),
        "router_ttft_interactive": stats.get("router_ttft_interactive"),
    }


def build_report(settings: dict[str, Any], limits: Limits, phase_records: dict[str, list[RequestRecord]],
                 windows: dict[str, tuple[float, float]], samples: Sequence[dict[str, Any]],
                 origin_unix: float) -> dict[str, Any]:
    """`windows` and records on one clock: seconds since `origin_unix`; samples carry unix times and a phase."""
    phases = {}
    for name in PHASES:
        if name not in windows:
            continue
        phase_samples = [s for s in samples if s.get("phase") == name]
        phases[name] = summarize_phase(name, phase_records.get(name, []), limits.interactive_ttft_slo_s,
                                       windows[name], phase_samples, limits.hot_max_num_seqs)
    return {
        "settings": settings,
        "limits": limits.to_json(),
        "origin_unix": origin_unix,
        "windows_s": {k: list(v) for k, v in windows.items()},
        "phases": phases,
        "headline": headline(phases, limits),
        "samples": list(samples),
        "records": {name: [r.to_json() for r in records] for name, records in phase_records.items()},
    }


# --------------------------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------------------------


def _num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f} %"


def _triple(values: dict[str, Any], keys: Sequence[str], digits: int = 1) -> str:
    return " / ".join(_num(values.get(k), digits) for k in keys)


CLASS_ROWS: list[tuple[str, Any]] = [
    ("sent / admitted / completed", lambda c: f"{c['sent']} / {c['admitted']} / {c['completed']}"),
    ("429", lambda c: _num(c["rejected_429"])),
    ("Retry-After min / median / max (s)", lambda c: _triple(c["retry_after_s"], ("min", "median", "max"))
     + (f" ({c['retry_after_s']['missing']} missing)" if c["retry_after_s"]["missing"] else "")),
    ("other errors", lambda c: ", ".join(f"{k}: {v}" for k, v in c["other_errors"].items()) or "none"),
    ("admitted TTFT p50 / p90 / p99 (ms)", lambda c: _triple(c["ttft_ms"], ("p50", "p90", "p99"))),
    ("TTFT SLO (s): within / p99 within", lambda c: "–" if c["ttft_slo_s"] is None else
     f"{c['ttft_slo_s']:g}: {_pct(c['ttft_within_slo'])} / {_num(c['ttft_p99_within_slo'])}"),
    ("admitted streams' TPOT p50 / p99 (ms)", lambda c: _triple(c.get("tpot_ms") or {}, ("p50", "p99"))),
    ("admitted by lane", lambda c: ", ".join(f"{k}: {v}" for k, v in c["lanes"].items()) or "–"),
    ("TTFT p50 / p99 by lane (ms)", lambda c: "; ".join(f"{k}: {_triple(v, ('p50', 'p99'))}"
                                                        for k, v in c.get("ttft_ms_by_lane", {}).items()) or "–"),
    ("share on the hot lane", lambda c: _pct(c["hot_share"])),
    ("admitted marked hot_saturated", lambda c: _num(c["hot_saturated"])),
    ("mean generating on the hot lane in the window", lambda c: _num(c.get("hot_in_flight_mean"), 2)),
    ("completed in the phase's window", lambda c: _num(c.get("completed_in_window"))),
    ("output tokens/s in the window", lambda c: _num(c.get("tokens_per_s_in_window"))),
]

STATS_ROWS: list[tuple[str, str]] = [
    ("stats samples (answered)", "answered"),
    ("samples with interactive requests held by the Router", "with_interactive_held"),
    ("... while the hot engines ran fewer than max_num_seqs", "held_while_hot_below_max_num_seqs"),
    ("... while the hot engines ran none", "held_while_hot_running_none"),
    ("... while the hot engines ran fewer than router.hot_slots limit", "held_while_hot_below_slots_limit"),
    ("hot engines running: max", "hot_running_max"),
    ("hot engines running: mean", "hot_running_mean"),
    ("hot engines running + waiting: max", "hot_in_engine_max"),
    ("Router queued interactive: max", "queued_interactive_max"),
    ("router.hot_slots limit", "hot_slots_limit"),
    ("router.hot_slots in flight: max", "hot_slots_in_flight_max"),
    ("router.hot_slots waiting: max", "hot_slots_waiting_max"),
]


def render_markdown(report: dict[str, Any]) -> str:
    settings, limits, head = report["settings"], report["limits"], report["headline"]
    lines = ["# Overload", ""]
    lines += [f"Config `{settings.get('serve_config')}`: hot lane {limits['hot_replicas']} replica(s) x "
              f"max_num_seqs {limits['hot_max_num_seqs']} = capacity {limits['hot_capacity']}; "
              f"realtime_max_inflight {limits['realtime_max_inflight']}; Router replicas {limits['router_replicas']}; "
              f"interactive_ttft_slo_s {limits['interactive_ttft_slo_s']:g}.", ""]
    lines += [f"Phases: light {settings['light_rate']:g}/s for {settings['light_s']:g} s; "
              f"quiet {settings['quiet_s']:g} s; "
              f"burst {settings['interactive']} interactive + {settings['flex']} flex closed-loop streams for "
              f"{settings['burst_s']:g} s from {settings['clients']} client process(es); {settings['max_tokens']} "
              f"output tokens per request; stats every {settings['sample_interval_s']:g} s; refused streams "
              + (f"send the refused request again, the same, {settings['resend_refused_after_s']:g} s later "
                 "whatever its Retry-After." if settings.get("resend_refused_after_s") is not None
                 else "wait the Retry-After before their next request." if settings.get("wait_on_refusal")
                 else "send their next request at once."), ""]
    for phase, usages in (settings.get("generators") or {}).items():
        shown = [f"{u['on_cpu_per_s']:.2f} / {u['runqueue_wait_per_s']:.2f}" for u in usages if u]
        if shown:
            lines += [f"Load generator ({phase}), per client process, on a CPU / waiting for one (s per s): "
                      + ", ".join(shown) + ".", ""]
    if settings.get("autogroup"):
        lines += ["**The kernel's autogroup scheduling was on**: on a small host the app's Ray workers compete with "
                  "the load generator as equals, so client-side latencies include the generator's own waits "
                  "(load_tests/README.md).", ""]
    ra = head.get("retry_after_s") or {}
    lines += ["## Burst, headline", "",
              f"- interactive admitted {_num(head['interactive_admitted'])}, 429 {_num(head['interactive_429'])} "
              f"(Retry-After min / median / max {_triple(ra, ('min', 'median', 'max'))} s)",
              f"- admitted interactive on the hot lane: {_num(head['interactive_on_hot'])} "
              f"({_pct(head['interactive_hot_share'])}); marked hot_saturated: "
              f"{_num(head['interactive_hot_saturated'])}; on average "
              f"{_num(head['interactive_hot_in_flight_mean'], 2)} generating on the hot lane (capacity "
              f"{head['hot_capacity']})",
              f"- admitted interactive TTFT p50 / p99: {_num(head['interactive_ttft_p50_ms'])} / "
              f"{_num(head['interactive_ttft_p99_ms'])} ms against {head['interactive_ttft_slo_s']:g} s "
              f"(p99 within: {_num(head['interactive_ttft_p99_within_slo'])})",
              f"- flex completed in the burst window: {_num(head['flex_completed_in_window'])}, "
              f"{_num(head['flex_tokens_per_s_in_window'])} output tokens/s",
              f"- idle hot lane: {_num(head['samples_held_while_hot_below_max_num_seqs'])} of "
              f"{_num(head['samples_interactive_held'])} samples with interactive requests held by the Router had the "
              f"hot engines below max_num_seqs ({_num(head['samples_held_while_hot_running_none'])} with none "
              f"running"
              + (f", {head['samples_held_while_hot_below_slots_limit']} below the Router's hot_slots limit"
                 if head.get("samples_held_while_hot_below_slots_limit") is not None else "")
              + f"); most in the hot engines at once: {_num(head['hot_in_engine_max'])}",
              *([f"- waiting in the Router for a hot slot in {head['samples_waiting_for_hot_slot']} samples, "
                 f"{head['samples_waiting_for_hot_slot_while_hot_running_none']} of them with the hot engines "
                 "running none"] if head.get("samples_waiting_for_hot_slot") is not None else []),
              *([f"- the Router's own interactive TTFT p50 / p99 (ms), recent window at the burst's end: "
                 + ", ".join(f"{lane} {_num(v['p50_ms'])} / {_num(v['p99_ms'])} ({v['count']})"
                             for lane, v in sorted(head["router_ttft_interactive"].items()))]
                if head.get("router_ttft_interactive") else []),
              f"- 5xx: {_num(head['server_errors_5xx'])}", ""]
    for name, phase in report["phases"].items():
        lines += [f"## {name}" + (f" ({phase['window_s']:.0f} s)" if phase.get("window_s") else ""), ""]
        classes = phase["classes"]
        if classes:
            titles = {"interactive": "interactive", "batch": "flex"}
            lines += ["| metric | " + " | ".join(titles[c] for c in classes) + " |",
                      "|---|" + "---|" * len(classes)]
            for title, cell in CLASS_ROWS:
                lines.append(f"| {title} | " + " | ".join(cell(c) for c in classes.values()) + " |")
            lines.append("")
        stats = phase["stats"]
        lines += ["| /v1/admin/stats | value |", "|---|---|"]
        lines += [f"| {title} | {_num(stats.get(key))} |" for title, key in STATS_ROWS]
        lines.append("")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "markdown": out_dir / "report.md"}
    paths["json"].write_text(json.dumps(report, indent=1), encoding="utf-8")
    paths["markdown"].write_text(render_markdown(report), encoding="utf-8")
    return paths


# --------------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Settings:
    serve_config: str
    url: str
    out: Path
    interactive: int
    flex: int
    burst_s: float
    clients: int
    light_rate: float
    light_s: float
    quiet_s: float
    max_tokens: int
    prompt_tokens: dict[str, Any]
    sample_interval_s: float
    request_timeout_s: float
    seed: int
    wait_on_refusal: bool = True
    resend_refused_after_s: float | None = None
    overrides: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        from load_tests import host

        return {"serve_config": self.serve_config, "url": self.url, "interactive": self.interactive,
                "flex": self.flex, "burst_s": self.burst_s, "clients": self.clients, "light_rate": self.light_rate,
                "light_s": self.light_s, "quiet_s": self.quiet_s, "max_tokens": self.max_tokens,
                "prompt_tokens": self.prompt_tokens, "sample_interval_s": self.sample_interval_s,
                "request_timeout_s": self.request_timeout_s, "seed": self.seed,
                "wait_on_refusal": self.wait_on_refusal, "resend_refused_after_s": self.resend_refused_after_s,
                "overrides": self.overrides,
                "autogroup": host.autogroup_enabled()}


def _log(message: str) -> None:
    print(f"[overload {dt.datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure(settings: Settings, limits: Limits, model: str) -> dict[str, Any]:
    """The three phases against the app at settings.url; the report."""
    out = settings.out
    work = out / "clients"
    origin = time.time()
    windows: dict[str, tuple[float, float]] = {}
    phase_records: dict[str, list[RequestRecord]] = {}
    generators: dict[str, list[dict[str, float] | None]] = {}
    with StatsSampler(settings.url, settings.sample_interval_s, out / "stats.jsonl") as sampler:
        if settings.light_s > 0:
            sampler.phase = "light"
            _log(f"light: {settings.light_rate:g}/s interactive for {settings.light_s:g} s")
            begin = time.time() - origin
            results = run_clients([light_scenario(model, settings.light_rate, settings.light_s, settings.max_tokens,
                                                  settings.prompt_tokens, settings.seed,
                                                  settings.request_timeout_s)], settings.url, work, "light")
            phase_records["light"] = records_from(results, origin)
            generators["light"] = [r.get("generator") for r in results]
            windows["light"] = (min([begin] + [r["start_unix"] - origin for r in results]), time.time() - origin)
        if settings.quiet_s > 0:
            sampler.phase = "quiet"
            _log(f"quiet: {settings.quiet_s:g} s")
            begin = time.time() - origin
            time.sleep(settings.quiet_s)
            windows["quiet"] = (begin, time.time() - origin)
        sampler.phase = "burst"
        _log(f"burst: {settings.interactive} interactive + {settings.flex} flex streams for {settings.burst_s:g} s "
             f"from {settings.clients} client processes")
        results = run_clients(burst_scenarios(model, settings.interactive, settings.flex, settings.clients,
                                              settings.burst_s, settings.max_tokens, settings.prompt_tokens,
                                              settings.seed, settings.request_timeout_s),
                              settings.url, work, "burst", settings.wait_on_refusal, settings.resend_refused_after_s)
        phase_records["burst"] = records_from(results, origin)
        generators["burst"] = [r.get("generator") for r in results]
        burst_start = min(r["start_unix"] for r in results) - origin
        windows["burst"] = (burst_start, burst_start + settings.burst_s)
        sampler.phase = "after"
    # Samples are tagged by the phase set when they were taken; the burst's are those inside its window
    # (client start-up excluded), the drain after it is "after".
    for sample in sampler.samples:
        if sample["phase"] in ("burst", "after"):
            t = sample["t"] - origin
            sample["phase"] = "burst" if windows["burst"][0] <= t < windows["burst"][1] else "after"
    return build_report({**settings.to_json(), "generators": generators}, limits, phase_records, windows,
                        sampler.samples, origin)


def derived_config(document: dict[str, Any], overrides: list[str], out: Path) -> dict[str, Any]:
    """The serve config to start: --set overrides on the app's args, the batch store in `out` (unless overridden)."""
    from load_tests.serve_runner import llm_lanes_application

    document = copy.deepcopy(document)

    application = llm_lanes_application(document)
    args = application.get("args") or {}
    if not any(o.split("=", 1)[0].strip() == "batch.store" for o in overrides):
        batch = dict(args.get("batch") or {})
        if not str(batch.get("store", "")).startswith(("postgres://", "postgresql://")):
            batch["store"] = str((out / "batches.sqlite3").resolve())
            args = {**args, "batch": batch}
    application["args"] = apply_overrides(args, overrides)
    return document


def rebuild(out_dir: Path) -> dict[str, Path]:
    """Recompute report.json's summaries and report.md from its own settings, records, windows and samples."""
    saved = json.loads((out_dir / "report.json").read_text(encoding="utf-8"))
    limits = Limits(**{k: v for k, v in saved["limits"].items() if k != "hot_capacity"})
    records = {name: [RequestRecord(**raw) for raw in raws] for name, raws in saved["records"].items()}
    windows = {name: (span[0], span[1]) for name, span in saved["windows_s"].items()}
    report = build_report(saved["settings"], limits, records, windows, saved["samples"], saved["origin_unix"])
    return write_report(report, out_dir)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker_main(argv[1:])
    if argv and argv[0] == "rebuild":
        paths = rebuild(Path(argv[1]))
        print(paths["markdown"].read_text(encoding="utf-8"))
        return 0
    parser = argparse.ArgumentParser(prog="python -m load_tests.overload", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-config", required=True, help="serve config to start (and to read limits from)")
    parser.add_argument("--url", default=None,
                        help="measure the app already running here instead of starting one (the config still "
                             "supplies the limits)")
    parser.add_argument("--out", required=True, help="directory for report.json, report.md, stats.jsonl, logs")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the app's args (dotted path, YAML value), e.g. "
                             "model.source=/abs/models/tiny-llama; repeatable")
    parser.add_argument("--interactive", type=int, default=None, help="interactive streams in the burst (default 160)")
    parser.add_argument("--interactive-x", type=float, default=None,
                        help="interactive streams as a multiple of the hot lane's capacity (max_num_seqs x replicas)")
    parser.add_argument("--flex", type=int, default=16, help="flex streams in the burst")
    parser.add_argument("--burst-s", type=float, default=40.0, help="seconds the burst's streams keep sending")
    parser.add_argument("--clients", type=int, default=2, help="client processes for the burst")
    parser.add_argument("--light-rate", type=float, default=3.0, help="interactive requests/s in the light phase")
    parser.add_argument("--light-s", type=float, default=20.0, help="light phase length (0: none)")
    parser.add_argument("--quiet-s", type=float, default=20.0, help="quiet phase length (0: none)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[48, 80], metavar=("MIN", "MAX"),
                        help="prompt length in tokens, uniform")
    parser.add_argument("--sample-interval", type=float, default=1.5, help="seconds between stats samples")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="per-request timeout in seconds")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the app to start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-wait-on-refusal", action="store_true",
                        help="burst streams send their next request at once after a refusal (default: they wait "
                             "its Retry-After, 1 s without one)")
    parser.add_argument("--resend-refused-after", type=float, default=None, metavar="S",
                        help="burst streams send a refused request again, the same, S seconds later whatever its "
                             "Retry-After (a naive retry loop)")
    args = parser.parse_args(argv)
    if args.clients < 1:
        parser.error("--clients must be >= 1")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    document = yaml.safe_load(Path(args.serve_config).read_text(encoding="utf-8"))
    try:
        document = derived_config(document, args.overrides, out)
        served_args = app_args(document)
        limits = limits_from_args(served_args)
        interactive = interactive_streams(args.interactive, args.interactive_x, limits.hot_capacity)
    except ValueError as error:
        parser.error(str(error))
    model = (served_args.get("model") or {}).get("served_name") or "tiny-llama"

    from load_tests.serve_runner import AppStartError, app_url, serve_and_run

    url = (args.url or app_url(document)).rstrip("/")
    settings = Settings(
        serve_config=args.serve_config, url=url, out=out, interactive=interactive, flex=args.flex,
        burst_s=args.burst_s, clients=args.clients, light_rate=args.light_rate, light_s=args.light_s,
        quiet_s=args.quiet_s, max_tokens=args.max_tokens,
        prompt_tokens={"dist": "uniform", "min": args.prompt_tokens[0], "max": args.prompt_tokens[1]},
        sample_interval_s=args.sample_interval, request_timeout_s=args.request_timeout, seed=args.seed,
        wait_on_refusal=not args.no_wait_on_refusal, resend_refused_after_s=args.resend_refused_after,
        overrides=args.overrides,
    )
    if args.url:
        report = measure(settings, limits, model)
    else:
        try:
            report = serve_and_run(document, Path(args.serve_config).name, out, args.ready_timeout,
                                   lambda _url: measure(settings, limits, model), _log)
        except AppStartError as error:
            print(error, file=sys.stderr)
            return 1
    paths = write_report(report, out)
    print(paths["markdown"].read_text(encoding="utf-8"))
    print("report: " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

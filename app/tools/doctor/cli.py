"""Doctor: the tuning guide's troubleshooting flows, run against a running llm-lanes app.

    python -m app.tools.doctor --url http://127.0.0.1:8000 [--metrics-url http://127.0.0.1:8080/metrics]
        [--serve-config serve_configs/local.yaml] [--trace-file spans.jsonl] [--window-s 30] [--json]

The three flows of the guide's troubleshooting section, each as findings (OK / WARN / PROBLEM) with the numbers
behind them and what to do, never raw dumps:

1. OOM with low GPU use: requests with abnormally long contexts (prompt-length histogram tail vs max_model_len and
   the long-context threshold, long-context degrade counts), max_num_batched_tokens vs the longest prompts, KV usage
   near full with preemptions.
2. Throughput drop: engine stats per replica (running / waiting / KV usage): waiting with a full KV cache or at
   max_num_seqs means a starved scheduler; idle replicas next to a loaded one mean routing imbalance; request
   errors / rejections; a batch backlog that the cold lane is not draining; open circuit breakers.
3. Long tail: p99/p50 of TTFT and E2E per lane and class from the histograms, where the p99 time goes (admission
   queue, engine queue, prefill, decode), the slowest traces and each class's TTFT by hop (Router, Serve hops, engine)
   when a span file is given, and how to profile (nsys).

Inputs: GET /v1/admin/stats and GET /v1/models of the app, the Prometheus text of Ray's metrics export port
(`ray_llm_lanes_*` and vLLM's `ray_vllm_*`), optionally the serve config (engine limits) and a JSON-lines span
file (app.observability.tracing's "file" exporter). Counters and histograms are cumulative since the replicas
started; `--window-s N` scrapes twice N seconds apart and judges the difference (what happens now).

Structure: the checks are pure functions of a `DoctorInputs` record (`run_checks(inputs)`); `gather_inputs()` is
the only code that talks to the network or reads files. Exit code: 0 without PROBLEM findings, 1 with any,
2 when the app cannot be reached or --serve-config cannot be read (nothing was diagnosed).
"""

from __future__ import annotations

import argparse
import sys

from app.tools.doctor.checks import exit_code, run_checks
from app.tools.doctor.checks_long_tail import profiling_guidance
from app.tools.doctor.inputs import (
    DEFAULT_METRICS_URL, DEFAULT_URL, AppUnreachable, ServeConfigUnreadable, gather_inputs,
)
from app.tools.doctor.model import _n
from app.tools.doctor.render import render_json, render_text
from app.tools.doctor.thresholds import DEFAULT_SLOWEST_TRACES, REALTIME_TTFT_P99_GOAL_S, SCHEMA_LONG_CONTEXT_THRESHOLD


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app.tools.doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the app's HTTP base URL (default {DEFAULT_URL})")
    parser.add_argument("--metrics-url", default=DEFAULT_METRICS_URL,
                        help=f"Ray's metrics export endpoint (default {DEFAULT_METRICS_URL}); '' to skip")
    parser.add_argument("--serve-config", default=None,
                        help="serve config of the running app: engine limits (max_num_seqs, max_num_batched_tokens) "
                             "and the long-context threshold")
    parser.add_argument("--app-name", default=None, help="application in the serve config (default: the first)")
    parser.add_argument("--trace-file", default=None,
                        help="JSON-lines span file (tracing exporter 'file'); skipped if absent")
    parser.add_argument("--window-s", type=float, default=0.0,
                        help="scrape metrics twice this many seconds apart and judge the difference (default: "
                             "cumulative since start)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="HTTP timeout per call")
    parser.add_argument("--long-context-threshold", type=int, default=None,
                        help=f"prompt tokens above which a request should run on the cold lane (default: the serve "
                             f"config's, else {SCHEMA_LONG_CONTEXT_THRESHOLD})")
    parser.add_argument("--realtime-ttft-p99-s", type=float, default=REALTIME_TTFT_P99_GOAL_S,
                        help=f"realtime TTFT p99 goal (default {REALTIME_TTFT_P99_GOAL_S}, the tuning guide's)")
    parser.add_argument("--slowest", type=int, default=DEFAULT_SLOWEST_TRACES, help="slowest traces to list")
    parser.add_argument("--json", action="store_true", help="print findings as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    metrics_url = args.metrics_url or None
    try:
        inputs = gather_inputs(
            args.url, metrics_url, serve_config=args.serve_config, app_name=args.app_name,
            trace_file=args.trace_file, window_s=args.window_s, timeout_s=args.timeout_s,
            long_context_threshold=args.long_context_threshold, realtime_ttft_p99_goal_s=args.realtime_ttft_p99_s,
            slowest_traces=args.slowest,
        )
    except AppUnreachable as error:
        print(f"doctor: the app at {args.url} is not reachable: {error}\n"
              "Is it running (serve run serve_configs/...), and is --url its HTTP address?", file=sys.stderr)
        return 2
    except ServeConfigUnreadable as error:
        print(f"doctor: {error}", file=sys.stderr)
        return 2
    findings = run_checks(inputs)
    profiling = profiling_guidance(args.serve_config)
    if args.json:
        print(render_json(findings, inputs, args.url, metrics_url, profiling))
    else:
        header = (f"doctor: {args.url}" + (f", metrics {metrics_url}" if inputs.metrics is not None else "")
                  + (f", max_model_len {_n(inputs.max_model_len)}" if inputs.max_model_len else "")
                  + f", {len(inputs.replicas)} engine replicas"
                  + (f", window {inputs.window_s:g} s" if inputs.window_s else ", counters since start"))
        print(render_text(findings, inputs, header, profiling))
    return exit_code(findings)


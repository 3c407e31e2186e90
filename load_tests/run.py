"""Run a scenario against a running app, or start the app under each of several serve configs in turn.

    python -m load_tests.run --scenario load_tests/scenarios/mixed.yaml --url http://127.0.0.1:8000 \
        --out load_tests/results/mixed
    python -m load_tests.run --scenario load_tests/scenarios/mixed.yaml \
        --serve-config serve_configs/local.yaml --serve-config serve_configs/baseline-local.yaml \
        --out load_tests/results/lanes-vs-single-pool

The second form writes one report comparing the configs (ratios are first ÷ second). Run it from the repository root
(serve configs name `app.main:build_app` and relative model paths). A config may be an overlay
(load_tests/configs/*.yaml: a shipped config plus the keys that differ), and `--set KEY=VALUE` after a
--serve-config changes one value of that config (load_tests/overlay.py); the merged file is written next to the
report and served from there:

    python -m load_tests.run --scenario load_tests/scenarios/shared_prefix.yaml \
        --serve-config load_tests/configs/prefix-2x.yaml \
        --serve-config load_tests/configs/prefix-2x.yaml --set args.prefix_cache.routing=pow2 --out DIR

`--direct-ingress` (with --serve-config) starts each app with Ray Serve's direct ingress on and sends the scenario
to the Router replicas' own ports instead of the HTTP proxy (load_tests/direct_ingress.py). In --url mode, list the
replicas' URLs comma-separated instead.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from load_tests import direct_ingress, host
from load_tests.client import RequestRecord
from load_tests.overlay import ConfigRef, OverlayError, add_serve_config_arguments, as_ref
from load_tests.report import RunResult, write_report
from load_tests.scenario import Scenario, ScenarioError, load_scenario
from load_tests.serve_runner import (
    AppStartError,
    ServedApp,
    default_cleanup_commands,
    default_start_command,
    default_stop_commands,
)
from load_tests.workload import run_scenario

DEFAULT_URL = "http://127.0.0.1:8000"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def measure(scenario: Scenario, url: str, label: str, target: str, progress: bool = True) -> RunResult:
    result = RunResult(label=label, target=target, started_at=_now())
    bar = tqdm(total=scenario.expected_requests(), desc=label, unit="req", disable=not progress, dynamic_ncols=True)
    failures = 0

    def done(record: RequestRecord) -> None:
        nonlocal failures
        failures += not record.ok
        bar.update(1)
        bar.set_postfix(errors=failures, refresh=False)

    # Warm-up included: the samples bracket the whole asyncio.run, so the rates divide by its elapsed time.
    before, started = host.sample(), time.perf_counter()
    try:
        result.records, result.wall_s = asyncio.run(run_scenario(scenario, url, on_done=done))
        result.measured_from_unix = round(time.time() - result.wall_s, 3)
    finally:
        bar.close()
    result.generator = host.usage(before, host.sample(), time.perf_counter() - started)
    if result.generator is not None:
        result.generator["autogroup"] = host.autogroup_enabled()
    return result


def run_serve_configs(
    scenario: Scenario,
    serve_configs: list[str | ConfigRef],
    url: str,
    out_dir: Path,
    ready_timeout_s: float,
    progress: bool,
    start_command_for: Callable[[str], list[str]] = default_start_command,
    stop_commands: list[list[str]] | None = None,
    cleanup_commands: list[list[str]] | None = None,
    poll_interval_s: float = 2.0,
    use_direct_ingress: bool = False,
) -> list[RunResult]:
    """One run per config, each on a freshly started app. The command arguments exist for tests (a stand-in app).
    An overlay or a config with --set values is merged into out_dir first and served from there."""
    runs = []
    for ref in map(as_ref, serve_configs):
        label = ref.label + ("-direct-ingress" if use_direct_ingress else "")
        config = ref.path if not ref.sets else f"{ref.path} " + " ".join(f"--set {s}" for s in ref.sets)
        try:
            served = ref.servable_path(out_dir)
        except OverlayError as error:
            print(f"[{label}] {error}", file=sys.stderr)
            runs.append(RunResult(label=label, target=config, started_at=_now(), error=str(error)))
            continue
        app = ServedApp(
            url,
            out_dir / f"serve-{label}.log",
            start_command=start_command_for(served),
            stop_commands=default_stop_commands() if stop_commands is None else stop_commands,
            cleanup_commands=default_cleanup_commands() if cleanup_commands is None else cleanup_commands,
            ready_timeout_s=ready_timeout_s,
            poll_interval_s=poll_interval_s,
            env=direct_ingress.ENV if use_direct_ingress else None,
        )
        print(f"[{label}] starting `serve run {served}` (log: {app.log_path})", file=sys.stderr)
        try:
            app.start()
            ready_s = app.wait_ready()
            print(f"[{label}] ready after {ready_s:.0f} s", file=sys.stderr)
            target_url = url
            if use_direct_ingress:
                serve_config = ref.load()
                target_url = direct_ingress.router_urls(serve_config, [app.log_path])
                print(f"[{label}] direct ingress: {target_url}", file=sys.stderr)
            runs.append(measure(scenario, target_url, label, config, progress))
            save_admin_stats(url, out_dir / f"admin-stats-{label}.json")
        except (AppStartError, TimeoutError) as error:
            print(f"[{label}] {error}", file=sys.stderr)
            runs.append(RunResult(label=label, target=config, started_at=_now(), error=str(error).splitlines()[0]))
        finally:
            print(f"[{label}] shutting down", file=sys.stderr)
            app.stop()
    return runs


def save_admin_stats(url: str, path: Path) -> None:
    """The app's own view after the run (GET /v1/admin/stats: engines, prefix cache, replica-routing decision times),
    kept next to the report; best effort, the measurement does not depend on it."""
    import httpx

    try:
        path.write_text(httpx.get(f"{url}/v1/admin/stats", timeout=10).text)
    except httpx.HTTPError as error:
        print(f"could not save admin stats: {error}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", required=True, help="scenario YAML (see load_tests/scenarios/)")
    parser.add_argument("--url", default=None, help=f"base URL of a running app (default {DEFAULT_URL})")
    add_serve_config_arguments(
        parser, "start the app with `serve run CONFIG` (a serve config or an overlay in load_tests/configs), measure, "
                "tear down; repeat to compare configs")
    parser.add_argument("--out", required=True, help="directory for report.json, report.md, PNG plots, serve logs")
    parser.add_argument("--direct-ingress", action="store_true",
                        help="with --serve-config: start with Ray Serve's direct ingress and load the Router replicas' "
                             "own ports, not the HTTP proxy")
    parser.add_argument("--label", default=None, help="name of the run in --url mode (default: the URL)")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait until the app and every lane answer")
    parser.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    try:
        scenario = load_scenario(args.scenario)
    except (OSError, ScenarioError) as error:
        print(error, file=sys.stderr)
        return 2
    if args.seed is not None:
        scenario = scenario.model_copy(update={"seed": args.seed})
    url = args.url or DEFAULT_URL
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    if args.serve_config:
        runs = run_serve_configs(scenario, args.serve_config, url, out_dir, args.ready_timeout, not args.no_progress,
                                 use_direct_ingress=args.direct_ingress)
    else:
        runs = [measure(scenario, url, args.label or url, url, not args.no_progress)]

    paths = write_report(scenario, runs, out_dir)
    print(paths["markdown"].read_text(encoding="utf-8"))
    print("report: " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 1 if any(run.error for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The app against vLLM's own OpenAI server: the same engine arguments, the same client, one machine, one report.

    .venv/bin/python -m load_tests.vs_vllm --out load_tests/results/vs-vllm-cpu \
        --serve-config serve_configs/baseline-local.yaml --serve-config serve_configs/local.yaml

Targets, one after the other: for each `--serve-config`, vLLM's own OpenAI server
(`python -m vllm.entrypoints.openai.api_server`; the `vllm` console script of vllm-cpu fails on its package metadata)
with the engine arguments of that config's hot lane (once per distinct set of arguments), then the app under that
config (`serve run` of a derived copy: the batch store moved under `--out`). Each target is started, warmed up,
measured `--runs` times with vLLM's own benchmark client (`vllm bench serve`: openai-chat, random `--input-len` in /
`--output-len` out, `--num-prompts` at `--request-rate` req/s, `ignore_eos`), then once at saturation
(`--saturation-prompts` sent at once, `--saturation-concurrency` in flight: requests/s with the target always busy),
and stopped before the next starts. The engine arguments come from the app's own mapping
(`app.lanes.engine.engine_args_dict`), so both serve the same engine; a CPU binding of the lane (`cpu_threads_bind`)
is passed to the server as VLLM_CPU_OMP_THREADS_BIND.

With `--profile`, each app target gets one more run, not counted in the figures, sampled with py-spy (100 Hz,
non-blocking, only threads holding the GIL: Python's own work) in the HTTP proxy, the Router and the HotLane replica:
a flame graph per process (`profile/<target>-<process>.svg`) and the functions with the most samples in the report;
/proc CPU time per process over that run comes with it (load_tests/cpu_sampler.py).

With `--direct-ingress`, each app is started with Ray Serve's direct ingress (load_tests/direct_ingress.py) and
measured twice on the same running app: through the HTTP proxy (target `app-…`), then on the Router replica's own
port, without the proxy hop (target `app-…-direct`; a config of one Router replica, since the benchmark client
sends to one URL). Direct ingress is a cluster setting, not a serve-config key (docs/operators.md). With
`--haproxy` (implies `--direct-ingress`), Ray's HAProxy front door answers on the proxy's port in place of Serve's
Python proxy (load_tests/direct_ingress.py: HAPROXY_ENV); that target is named `app-…-haproxy`.

With `--serve-llm PYTHON`, Ray Serve LLM's OpenAI app (`ray.serve.llm.build_openai_app`, one `LLMConfig`) is one
more target, right after the first config's vLLM server: the engine arguments of the first `--serve-config`'s hot
lane, through Serve's proxy on that config's port, started with `serve run` under PYTHON, an interpreter whose
environment has Ray Serve LLM's packages (load_tests/serve_llm.py; its set-up in docs/benchmarks.md). Each app target
with the same engine arguments is also compared with it ("app ÷ Ray Serve LLM").

Outputs in --out: report.json (settings, every run's bench result), report.md (per target: TTFT p50 / p99, TPOT
p50, ITL p50, E2E p50, output tok/s, failures; requests/s at saturation; and each app target's ratios to vLLM's
server with the same engine arguments, and to Ray Serve LLM where it ran: the median of its runs over the median of
the other's), the per-run bench JSON files, the derived configs and every target's log.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from load_tests import cpu_sampler, direct_ingress, host
from load_tests.vs_vllm_report import FIGURES, render_markdown

VLLM_SERVER_PORT = 8100
READY_TIMEOUT_S = 600.0
# The processes profiled with --profile (cpu_sampler's labels), and how many functions the report lists for each.
PROFILED = {"proxy": "ProxyActor", "router": "ServeReplica:llm-lanes:Router",
            "hot-lane": "ServeReplica:llm-lanes:HotLane"}
PROFILE_TOP = 12
PROFILE_RATE_HZ = 100
def engine_cli_args(engine_args: dict[str, Any]) -> list[str]:
    """vLLM engine arguments (as AsyncEngineArgs takes them) -> the OpenAI server's command-line flags."""
    flags: list[str] = []
    for key, value in engine_args.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def server_engine(document: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The engine arguments of a serve config's hot lane, and the environment its CPU binding needs."""
    from app.config import AppConfig
    from app.lanes.engine import engine_args_dict
    from load_tests.overlay import llm_lanes_application

    cfg = AppConfig.model_validate(llm_lanes_application(document).get("args") or {})
    settings = cfg.hot_lane.engine
    engine_args = engine_args_dict(cfg, settings)
    # Stats on: the app's replicas log them too (its stat logger needs them); the server's periodic log line is all
    # they cost there.
    engine_args.pop("disable_log_stats", None)
    env = {"VLLM_CPU_OMP_THREADS_BIND": settings.cpu_threads_bind} if settings.cpu_threads_bind else {}
    return engine_args, env


def vllm_server_command(engine_args: dict[str, Any], port: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
            *engine_cli_args(engine_args)]


def bench_command(url: str, model: str, tokenizer: str, args: argparse.Namespace, result_dir: Path,
                  result_name: str, seed: int, max_concurrency: int | None = None) -> list[str]:
    closed_loop = ["--max-concurrency", str(max_concurrency)] if max_concurrency else []
    return [sys.executable, "-m", "load_tests.vs_vllm", "bench",
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url,
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate), "--seed", str(seed),
            "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name, "--disable-tqdm",
            *closed_loop]


def bench_main(argv: list[str]) -> int:
    """`vllm bench serve` through its module (the console script fails on vllm-cpu's package metadata)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m load_tests.vs_vllm bench")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


def top_functions(collapsed: str, top: int = PROFILE_TOP) -> list[tuple[str, float, float]]:
    """py-spy's raw (collapsed) stacks -> (function, share of samples where it runs itself, share where it is on the
    stack), the most frequent first by own share. A frame is "name (file:line)"; lines are merged per function."""
    own: dict[str, int] = {}
    anywhere: dict[str, int] = {}
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_function(frame) for frame in stack.split(";")]
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for name in set(frames):
            anywhere[name] = anywhere.get(name, 0) + count
    if not total:
        return []
    ranked = sorted(own, key=own.get, reverse=True)[:top]
    return [(name, own[name] / total, anywhere[name] / total) for name in ranked]


def _function(frame: str) -> str:
    """"handle (app/router/http_api.py:42)" -> "handle (app/router/http_api.py)"; long paths cut to their tail."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    short = "/".join(parts[-3:]) if len(parts) > 3 else path
    return f"{name} ({short})" if short else name


class Profiler:
    """py-spy on the proxy, the Router and the HotLane replica, and /proc CPU time of every process, for one run."""

    def __init__(self, out: Path, target: str, duration_s: float):
        self.out, self.target, self.duration_s = out / "profile", target, duration_s
        self.out.mkdir(parents=True, exist_ok=True)
        self.processes: list[subprocess.Popen] = []
        self.cpu_before: dict[int, tuple[str, float]] = {}
        self.began = 0.0

    def start(self) -> None:
        py_spy = str(Path(sys.executable).parent / "py-spy")
        labels = {label: pid for pid, (label, _) in cpu_sampler.snapshot().items()}
        for short, label in PROFILED.items():
            pid = labels.get(label)
            if pid is None:
                continue
            for fmt, suffix in (("raw", "txt"), ("flamegraph", "svg")):
                self.processes.append(subprocess.Popen(
                    [py_spy, "record", "--pid", str(pid), "--duration", str(int(self.duration_s)), "--rate",
                     str(PROFILE_RATE_HZ), "--nonblocking", "--gil", "--format", fmt,
                     "--output", str(self.out / f"{self.target}-{short}.{suffix}")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.cpu_before, self.began = cpu_sampler.snapshot(), time.monotonic()

    def finish(self) -> dict[str, Any]:
        cpu_after, wall = cpu_sampler.snapshot(), time.monotonic() - self.began
        cores: dict[str, float] = {}
        for pid, (label, cpu_s) in cpu_after.items():
            if pid in self.cpu_before:
                cores[label] = cores.get(label, 0.0) + (cpu_s - self.cpu_before[pid][1]) / wall
        for process in self.processes:
            process.wait(timeout=self.duration_s + 60)
        functions = {}
        for short in PROFILED:
            raw = self.out / f"{self.target}-{short}.txt"
            if raw.exists():
                functions[short] = top_functions(raw.read_text(encoding="utf-8", errors="replace"))
        busiest = dict(sorted(((k, round(v, 3)) for k, v in cores.items() if v >= 0.01), key=lambda kv: -kv[1]))
        return {"cores_by_process": busiest, "top_functions": functions}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over a target's runs, plus the totals that say whether the runs were clean."""
    summary: dict[str, Any] = {key: statistics.median(run[key] for run in runs) for _, key in FIGURES}
    summary["output_throughput"] = statistics.median(run["output_throughput"] for run in runs)
    summary["completed"] = sum(run["completed"] for run in runs)
    summary["failed"] = sum(run.get("failed", 0) for run in runs)
    return summary


def ratios(app: dict[str, Any], server: dict[str, Any]) -> dict[str, float]:
    return {key: app[key] / server[key] for _, key in FIGURES if server.get(key)}


def _log(message: str) -> None:
    print(f"[vs_vllm {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _measure(name: str, url: str, model: str, tokenizer: str, args: argparse.Namespace, out: Path,
             profile: bool = False) -> tuple[list[dict], dict[str, Any] | None, dict[str, Any] | None]:
    """The target's runs at the request rate, its saturation run (or None), its profile (or None)."""
    from load_tests.serve_runner import checkout_env

    env = {**os.environ, **checkout_env()}
    warm = argparse.Namespace(**{**vars(args), "num_prompts": max(int(args.request_rate), 4)})
    subprocess.run(bench_command(url, model, tokenizer, warm, out / "warmup", f"{name}.json", seed=999),
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    runs = []
    profiled = None
    for run in range(args.runs):
        result_name = f"{name}-run{run + 1}.json"
        _log(f"{name}: run {run + 1} of {args.runs}")
        subprocess.run(bench_command(url, model, tokenizer, args, out / "bench", result_name, seed=args.seed + run),
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        runs.append(json.loads((out / "bench" / result_name).read_text(encoding="utf-8")))
    saturation = None
    if args.saturation_prompts:
        # Requests/s with the target always busy: every request sent at once, `--saturation-concurrency` in flight
        # (a closed loop, so the app's admission has no reason to refuse any).
        _log(f"{name}: saturation run ({args.saturation_concurrency} in flight)")
        closed = argparse.Namespace(**{**vars(args), "num_prompts": args.saturation_prompts, "request_rate": "inf"})
        result_name = f"{name}-saturation.json"
        subprocess.run(bench_command(url, model, tokenizer, closed, out / "bench", result_name,
                                     seed=args.seed, max_concurrency=args.saturation_concurrency),
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        saturation = saturation_figures(json.loads((out / "bench" / result_name).read_text(encoding="utf-8")),
                                        args.saturation_concurrency)
    if profile:
        _log(f"{name}: profiled run")
        profiler = Profiler(out, name, args.num_prompts / args.request_rate + 5)
        profiler.start()
        subprocess.run(bench_command(url, model, tokenizer, args, out / "profile", f"{name}-bench.json",
                                     seed=args.seed), check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.STDOUT)
        profiled = profiler.finish()
    return runs, saturation, profiled


def saturation_figures(result: dict[str, Any], concurrency: int) -> dict[str, Any]:
    return {"request_throughput": result["request_throughput"], "output_throughput": result["output_throughput"],
            "completed": result["completed"], "failed": result.get("failed", 0), "concurrency": concurrency}


def plan_targets(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """The targets in the order they run: per config, vLLM's server (once per distinct engine arguments), Ray Serve
    LLM after the first config's server (with --serve-llm), then the app. An app target names the targets its ratios
    are taken over. ValueError for a config these options cannot measure."""
    from load_tests import serve_llm
    from load_tests.overload import derived_config
    from load_tests.overlay import load_serve_config

    plan: list[dict[str, Any]] = []
    servers: dict[str, str] = {}  # engine arguments (JSON) -> the server target that runs them
    serve_llm_key = serve_llm_name = None
    for index, config in enumerate(args.serve_config):
        document = load_serve_config(config)
        engine_args, server_env = server_engine(document)
        key = json.dumps([engine_args, server_env], sort_keys=True)
        if key not in servers:
            servers[key] = f"vllm-server-{len(servers) + 1}"
            plan.append({"name": servers[key], "config": config, "engine_args": engine_args, "env": server_env})
        if args.serve_llm and index == 0:
            serve_llm_key = key
            router_cpus, lane_cpus = serve_llm.app_reservations(document)
            llm_config = serve_llm.llm_config(engine_args, server_env, replica_cpus=lane_cpus)
            serve_llm_name = "serve-llm-1-haproxy" if args.haproxy else "serve-llm-1"
            plan.append({"name": "serve-llm-1", "config": config, "engine_args": engine_args, "llm_config": llm_config,
                         "serve_llm": serve_llm.serve_llm_document(document, llm_config, router_cpus)})
        name = f"app-{index + 1}-{Path(config).stem}"
        routers = direct_ingress.router_replicas(document)
        if args.direct_ingress and routers != 1:
            raise ValueError(f"--direct-ingress needs one Router replica; {config} has {routers} (vllm bench serve "
                             "sends to one URL)")
        plan.append({"name": name, "config": config, "document": derived_config(document, [], out / name),
                     "compared_with": servers[key], "engine_args": engine_args})
        # Only an app on the same engine arguments is compared with Ray Serve LLM.
        if key == serve_llm_key:
            plan[-1]["compared_with_serve_llm"] = serve_llm_name
    return plan


def check_serve_llm_main(argv: list[str]) -> int:
    """Ray Serve LLM's start-up steps that need no Ray, on the LLMConfig the benchmark would give it."""
    from load_tests import serve_llm
    from load_tests.overlay import load_serve_config

    parser = argparse.ArgumentParser(prog="python -m load_tests.vs_vllm check-serve-llm")
    parser.add_argument("--serve-config", default="serve_configs/baseline-local.yaml")
    parser.add_argument("--base", type=Path, help="the folder the config's model paths are relative to (default: "
                        "this one)")
    args = parser.parse_args(argv)
    document = load_serve_config(args.serve_config)
    engine_args, env = server_engine(document)
    router_cpus, lane_cpus = serve_llm.app_reservations(document)
    config = serve_llm.llm_config(engine_args, env, args.base, replica_cpus=lane_cpus)
    return serve_llm.check(serve_llm.serve_llm_document(document, config, router_cpus)["applications"][0]["args"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return bench_main(argv[1:])
    if argv and argv[0] == "check-serve-llm":
        return check_serve_llm_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m load_tests.vs_vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-config", action="append", required=True, help="app config to measure; repeatable")
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=8.0)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="one more run per app target with py-spy on the proxy, Router and HotLane replica")
    parser.add_argument("--saturation-prompts", type=int, default=128,
                        help="requests of each target's saturation run (requests/s with the target always busy); "
                             "0: no saturation run")
    parser.add_argument("--saturation-concurrency", type=int, default=16,
                        help="requests in flight in the saturation run")
    parser.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S)
    parser.add_argument("--direct-ingress", action="store_true",
                        help="start each app with Serve's direct ingress and measure it also on the Router's own port")
    parser.add_argument("--haproxy", action="store_true",
                        help="Ray's HAProxy front door in place of Serve's HTTP proxy on its port; implies "
                             "--direct-ingress")
    parser.add_argument("--serve-llm", metavar="PYTHON",
                        help="measure Ray Serve LLM's OpenAI app on the first config's hot-lane engine too, started "
                             "with `serve run` under this interpreter (its environment has Ray Serve LLM's packages)")
    args = parser.parse_args(argv)
    args.direct_ingress = args.direct_ingress or args.haproxy
    app_env = direct_ingress.HAPROXY_ENV if args.haproxy else direct_ingress.ENV if args.direct_ingress else {}

    from app.router.proxy_middlewares import CALLBACK_ENV
    from load_tests import serve_llm
    from load_tests.serve_runner import (AppStartError, ServedApp, app_url, checkout_env, default_cleanup_commands,
                                         default_start_command, default_stop_commands)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        plan = plan_targets(args, out)
    except ValueError as error:
        parser.error(str(error))

    targets: list[dict[str, Any]] = []
    for step in plan:
        name, engine_args = step["name"], step["engine_args"]
        model = engine_args.get("served_model_name") or engine_args["model"]
        tokenizer = engine_args.get("tokenizer") or engine_args["model"]
        if "serve_llm" in step:
            config_path = out / f"{name}.yaml"
            config_path.write_text(yaml.safe_dump(step["serve_llm"], sort_keys=False), encoding="utf-8")
            url = app_url(step["serve_llm"]).rstrip("/")
            # Ray Serve LLM has no readiness of its lanes to poll (one chat completion below says the engine is up),
            # and its proxy runs none of the app's middlewares (an empty callback path is none).
            served = ServedApp(url, out / f"{name}.log",
                               start_command=serve_llm.start_command(args.serve_llm, str(config_path)),
                               stop_commands=serve_llm.stop_commands(args.serve_llm),
                               cleanup_commands=serve_llm.cleanup_commands(args.serve_llm),
                               ready_timeout_s=args.ready_timeout, lanes_path=None,
                               env={**checkout_env(), **app_env, CALLBACK_ENV: ""})
        elif "document" not in step:
            url = f"http://127.0.0.1:{VLLM_SERVER_PORT}"
            served = ServedApp(url, out / f"{name}.log", start_command=vllm_server_command(engine_args,
                                                                                          VLLM_SERVER_PORT),
                               ready_timeout_s=args.ready_timeout, lanes_path=None, env=step["env"])
        else:
            (out / name).mkdir(parents=True, exist_ok=True)
            config_path = out / name / ("served-" + Path(step["config"]).name)
            config_path.write_text(yaml.safe_dump(step["document"], sort_keys=False), encoding="utf-8")
            url = app_url(step["document"]).rstrip("/")
            served = ServedApp(url, out / f"{name}.log", start_command=default_start_command(str(config_path)),
                               stop_commands=default_stop_commands(), cleanup_commands=default_cleanup_commands(),
                               ready_timeout_s=args.ready_timeout,
                               env={**checkout_env(), **app_env})
        _log(f"starting {name}")
        measured: list[tuple[str, list[dict], dict[str, Any] | None, dict[str, Any] | None]] = []
        try:
            served.start()
            _log(f"{name} ready after {served.wait_ready():.0f} s")
            if "serve_llm" in step:
                _log(f"{name} answering after {serve_llm.wait_answering(url, model, args.ready_timeout):.0f} s more")
            on_serve = "document" in step or "serve_llm" in step
            front_name = f"{name}-haproxy" if args.haproxy and on_serve else name
            measured.append((front_name, *_measure(front_name, url, model, tokenizer, args, out,
                                                   profile=args.profile and "document" in step)))
            if args.direct_ingress and "document" in step:
                direct_url = direct_ingress.router_urls(step["document"], [served.log_path])
                _log(f"{name}: direct ingress at {direct_url}")
                measured.append((f"{name}-direct", *_measure(f"{name}-direct", direct_url, model, tokenizer, args,
                                                             out)))
        except (AppStartError, TimeoutError, subprocess.CalledProcessError) as error:
            print(f"{name}: {error}", file=sys.stderr)
            return 1
        finally:
            served.stop()
        for measured_name, runs, saturation, profiled in measured:
            target = {"name": measured_name, "config": step["config"], "runs": runs, "summary": summarize(runs)}
            if saturation is not None:
                target["saturation"] = saturation
            if profiled is not None:
                target["profile"] = profiled
            if "document" in step:
                target["compared_with"] = step["compared_with"]
                # Ray Serve LLM is measured through the proxy (or HAProxy) only: the app's direct-ingress figures
                # have no counterpart there.
                if "compared_with_serve_llm" in step and not measured_name.endswith("-direct"):
                    target["compared_with_serve_llm"] = step["compared_with_serve_llm"]
            elif "serve_llm" in step:
                target["llm_config"] = step["llm_config"]
            else:
                target["server_flags"] = engine_cli_args(engine_args)
            targets.append(target)

    by_name = {target["name"]: target for target in targets}
    for target in targets:
        if "compared_with" in target:
            target["ratios"] = ratios(target["summary"], by_name[target["compared_with"]]["summary"])
        if "compared_with_serve_llm" in target:
            target["ratios_serve_llm"] = ratios(target["summary"],
                                                by_name[target["compared_with_serve_llm"]]["summary"])
    report = {"settings": vars(args), "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "autogroup": host.autogroup_enabled(), "targets": targets}
    (out / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    markdown = render_markdown(report)
    (out / "report.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The floor under the Router: what Ray Serve's HTTP ingress, and one deployment-handle call behind it, cost per
request on this host, with no vLLM and no llm-lanes code in the path.

The Router's request-rate ceiling (load_tests/overhead.py) is the app's whole path: HTTP, vLLM's serving code, the
request pipeline, a streaming handle call to the HotLane and the engine. This serves two stand-ins with the Serve
settings of the shipped configs (the base config's `runtime_env`: handle calls over gRPC, user code on the
replica's main loop) behind the same front door, and drives them with overhead.py's rate client (non-streamed
`/v1/completions`, max_tokens 1, closed loop, several client processes):

- `ingress`: a FastAPI ingress that reads the JSON body and answers a completion-shaped JSON itself;
- `handle`: the same, answering with what one streaming handle call to a second deployment yields (one chunk), as
  the Router's call to a lane does.

No Router built on Serve's Python ingress and one handle call per request gets above the `handle` ceiling on the
same host; the Router's own ceiling divided by it is the share of the floor the Router keeps.

    python -m load_tests.serve_floor --base-config serve_configs/baseline-gpu.yaml --haproxy \\
        --rate-concurrency 64 --rate-requests 4000 --rate-clients 8 --out OUT

writes OUT/report.json and OUT/report.md (and each stand-in's serve config and log).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from fastapi import Request

from load_tests import direct_ingress
from load_tests.overhead import Settings, front_door, measure_rate_ceiling, rate_level_row
from load_tests.overlay import load_serve_config
from load_tests.serve_runner import (AppStartError, ServedApp, app_url, checkout_env, default_cleanup_commands,
                                     default_start_command, default_stop_commands)

VARIANTS = ("ingress", "handle")
MODEL = "floor"
APP_NAME = "serve-floor"


# ---- the stand-ins (built by `serve run` from the config below) ------------------------------------------------------

def build_floor_app(args: dict[str, Any]):
    from fastapi import FastAPI
    from ray import serve

    api = FastAPI()

    @serve.deployment(name="FloorLane", max_ongoing_requests=1024)
    class FloorLane:
        async def generate(self, prompt: str):
            yield {"text": "x", "prompt_chars": len(prompt)}

    @serve.deployment(name="FloorIngress", max_ongoing_requests=1024)
    @serve.ingress(api)
    class FloorIngress:
        def __init__(self, lane=None):
            self.lane = lane.options(stream=True) if lane is not None else None

        @api.get("/v1/models")
        async def models(self) -> dict[str, Any]:
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @api.post("/v1/completions")
        async def completions(self, request: Request) -> dict[str, Any]:
            body = await request.json()
            text = ""
            if self.lane is not None:
                async for chunk in self.lane.generate.remote(str(body.get("prompt", ""))):
                    text += chunk["text"]
            return {"id": "cmpl-floor", "object": "text_completion", "model": MODEL,
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}}

    if args.get("variant") == "handle":
        return FloorIngress.bind(FloorLane.bind())
    return FloorIngress.bind()


def floor_config(base: dict[str, Any], variant: str) -> dict[str, Any]:
    """A serve config for one stand-in: the base config's front door (http_options) and its app's runtime_env."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
    application = base["applications"][0]
    floor_app = {"name": APP_NAME, "route_prefix": "/", "import_path": "load_tests.serve_floor:build_floor_app",
                 "args": {"variant": variant}}
    if application.get("runtime_env"):
        floor_app["runtime_env"] = application["runtime_env"]
    config = {key: base[key] for key in ("proxy_location", "http_options") if key in base}
    config["applications"] = [floor_app]
    return config


# ---- the run ---------------------------------------------------------------------------------------------------------

def render_markdown(report: dict[str, Any]) -> str:
    lines = ["# The floor under the Router: Serve's ingress and one handle call", "",
             f"Non-streamed /v1/completions (max_tokens 1) through {report['front_door']} to each stand-in; base "
             f"config `{report['base_config']}` (its front door and `runtime_env`); closed loop at each concurrency, "
             f"shared by the client processes. Started {report['started_at']}.", "",
             "| stand-in | concurrency | client processes | requests (ok) | req/s | E2E p50 / p99 (ms) | client CPU "
             "| errors |", "|---|---|---|---|---|---|---|---|"]
    for result in report["variants"]:
        if result.get("error"):
            lines.append(f"| `{result['variant']}` | failed: {result['error']} | | | | | | |")
            continue
        lines += [f"| `{result['variant']}` {rate_level_row(level)}" for level in result["rate_ceiling"]["levels"]]
    return "\n".join(lines) + "\n"


def _log(message: str) -> None:
    print(f"[serve_floor] {message}", file=sys.stderr, flush=True)


def run(settings: Settings, base_config: str, variants: list[str]) -> dict[str, Any]:
    base = load_serve_config(base_config)
    front = front_door(settings.to_json())
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    report: dict[str, Any] = {"base_config": base_config, "front_door": front, "started_at": started,
                              "settings": settings.to_json(), "variants": []}
    for variant in variants:
        config = floor_config(base, variant)
        config_path = settings.out_dir / f"serve-{variant}.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        app = ServedApp(app_url(config), settings.out_dir / f"serve-{variant}.log",
                        default_start_command(str(config_path)), stop_commands=default_stop_commands(),
                        cleanup_commands=default_cleanup_commands(), ready_timeout_s=settings.ready_timeout_s,
                        lanes_path=None,
                        env={**checkout_env(), **(direct_ingress.HAPROXY_ENV if settings.haproxy else {})})
        result: dict[str, Any] = {"variant": variant, "serve_config": str(config_path), "error": None}
        _log(f"{variant}: starting `serve run {config_path}`")
        try:
            app.start()
            result["ready_s"] = app.wait_ready()
            _log(f"{variant}: ready after {result['ready_s']:.0f} s; request-rate ceiling")
            result["rate_ceiling"] = measure_rate_ceiling(settings, app.url, MODEL)
        except (AppStartError, TimeoutError) as error:
            result["error"] = str(error).splitlines()[0]
        finally:
            app.stop()
        report["variants"].append(result)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.serve_floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-config", default="serve_configs/local.yaml",
                        help="the serve config whose front door and Serve settings the stand-ins take")
    parser.add_argument("--variant", action="append", choices=VARIANTS, default=None, help="default: both")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rate-concurrency", default="64", help="comma-separated closed-loop concurrency levels")
    parser.add_argument("--rate-requests", type=int, default=4000, help="requests per level")
    parser.add_argument("--rate-clients", type=int, default=1, help="load-generator processes per level")
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--haproxy", action="store_true", help="Ray's HAProxy front door in place of Serve's proxy")
    parser.add_argument("--ready-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = Settings(serve_config=args.base_config, out_dir=out, requests=0, concurrency=1, warmup=args.warmup,
                        max_tokens=1, prompt_words=16, rounds=0, seed=7, ready_timeout_s=args.ready_timeout,
                        variants=[], rate_concurrency=[int(c) for c in args.rate_concurrency.split(",") if c],
                        rate_requests=args.rate_requests, haproxy=args.haproxy, direct_ingress=args.haproxy,
                        rate_clients=args.rate_clients)
    report = run(settings, args.base_config, args.variant or list(VARIANTS))
    (out / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    (out / "report.md").write_text(render_markdown(report), encoding="utf-8")
    print(render_markdown(report))
    return 0 if not any(result["error"] for result in report["variants"]) else 1


if __name__ == "__main__":
    sys.exit(main())

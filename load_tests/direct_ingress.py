"""Ray Serve's direct ingress (Ray 2.60 feature flag): reach the Router replicas without the HTTP proxy hop.

With `RAY_SERVE_ENABLE_DIRECT_INGRESS=1` in the environment of `ray start` / `serve run`, every replica of the
ingress deployment (the Router) runs its own HTTP server on a port Ray allocates from 30000-31000 (gRPC from
40000-41000). The head node's proxy still answers on http_options.port (8000), so both paths can be measured on
one running app. A production setup puts a load balancer over the replica ports (or sets RAY_SERVE_ENABLE_HA_PROXY=1,
which starts HAProxy for that); the load generator spreads its requests over the ports itself (comma-separated
URLs, round robin).

Ray announces each port in the replica's log ("Successfully started RequestProtocol.HTTP server on port N"): in the
Router replicas' files under the Ray session's logs/serve/, which `serve run` also forwards to its own output when it
started the cluster itself; the ports are read from there.

    python -m load_tests.direct_ingress urls --serve-config CONFIG [--log serve.log] [--timeout 60]
    python -m load_tests.direct_ingress urls --expect 4 [--host 127.0.0.1] [--log serve.log] [--timeout 60]
print the comma-separated URLs once every Router replica of the config (or `--expect` of them) announced a port.
"""

from __future__ import annotations

import argparse
import glob
import re
import sys
import time
from pathlib import Path
from typing import Any

from load_tests.overlay import OverlayError, add_set_argument, load_serve_config
from load_tests.serve_runner import http_host, llm_lanes_application

ENV = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
# Ray's HAProxy front door: HAProxy takes http_options.port in place of Serve's Python proxy and forwards to the
# Router replicas' own ports (it needs direct ingress). It also listens on all interfaces for its statistics page
# (8404) and Prometheus exporter (9101), which Ray's template fixes: a measurement setting, not the local default's.
HAPROXY_ENV = {**ENV, "RAY_SERVE_ENABLE_HA_PROXY": "1"}
# The running session's Router replica logs (the app is named llm-lanes in every serve config).
ROUTER_REPLICA_LOGS = "/tmp/ray/session_latest/logs/serve/replica_*_Router_*.log"
# The controller's log names the port it gave each replica. Read when a replica's own log is silent: with
# RAY_SERVE_THROUGHPUT_OPTIMIZED=1 replicas buffer their log lines, so the announcement can come late or never.
CONTROLLER_LOGS = "/tmp/ray/session_latest/logs/serve/controller_*.log"
_HTTP_PORT_LINE = re.compile(r"Successfully started RequestProtocol\.HTTP server on port (\d+)")
_ALLOCATED_PORT_LINE = re.compile(r"Allocated RequestProtocol\.HTTP port (\d+) to replica (\w+)")
_REPLICA_LOG_ID = re.compile(r"replica_.*_Router_(\w+)\.log$")


def http_ports_from_log(text: str) -> list[int]:
    """Ports announced by ingress replicas, in order of announcement, without repeats."""
    ports: list[int] = []
    for match in _HTTP_PORT_LINE.finditer(text):
        port = int(match.group(1))
        if port not in ports:
            ports.append(port)
    return ports


def allocated_router_ports(controller_text: str, router_log_paths: list[str]) -> list[int]:
    """Ports the controller allocated to the Router replicas whose log files exist (the latest per replica)."""
    router_ids = [m.group(1) for path in router_log_paths if (m := _REPLICA_LOG_ID.search(path))]
    latest = {replica: int(port) for port, replica in _ALLOCATED_PORT_LINE.findall(controller_text)}
    return [latest[replica] for replica in router_ids if replica in latest]


def router_replicas(serve_config: dict[str, Any]) -> int:
    """How many Router replicas (direct-ingress servers) the llm-lanes app of this serve config runs (1 if the
    config has no llm-lanes app)."""
    try:
        application = llm_lanes_application(serve_config)
    except ValueError:
        return 1
    return int(((application.get("args") or {}).get("router") or {}).get("num_replicas", 1))


def _read_logs(patterns: list[str]) -> str:
    texts = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)) or [pattern]:
            try:
                texts.append(Path(path).read_text(encoding="utf-8", errors="replace"))
            except OSError:
                pass
    return "\n".join(texts)


def wait_for_urls(log_paths: list[str | Path], expected: int, host: str = "127.0.0.1", timeout_s: float = 60.0,
                  poll_s: float = 0.5, session_logs: str | None = ROUTER_REPLICA_LOGS,
                  controller_logs: str | None = CONTROLLER_LOGS) -> list[str]:
    """URLs of the Router replicas' own HTTP servers once `expected` of them are in the logs (paths or glob patterns,
    plus the running Ray session's Router logs, then the controller's allocations for those replicas);
    TimeoutError otherwise, saying what was found, so an app started without the flag fails with a clear message."""
    patterns = [str(path) for path in log_paths] + ([session_logs] if session_logs else [])
    deadline = time.monotonic() + timeout_s
    while True:
        ports = http_ports_from_log(_read_logs(patterns))
        if len(ports) < expected and session_logs and controller_logs:
            allocated = allocated_router_ports(_read_logs([controller_logs]), sorted(glob.glob(session_logs)))
            ports += [port for port in allocated if port not in ports]
        if len(ports) >= expected:
            return [f"http://{host}:{port}" for port in ports[:expected]]
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{', '.join(patterns)}: {len(ports)} of {expected} Router replicas announced a direct-ingress "
                f"HTTP port within {timeout_s:.0f} s; was the app started with RAY_SERVE_ENABLE_DIRECT_INGRESS=1?")
        time.sleep(poll_s)


def router_urls(serve_config: dict[str, Any], log_paths: list[str | Path], timeout_s: float = 60.0) -> str:
    """The comma-separated URLs of every Router replica of the app this serve config started (see wait_for_urls)."""
    return ",".join(wait_for_urls(log_paths, router_replicas(serve_config), http_host(serve_config), timeout_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.direct_ingress", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    urls = sub.add_parser("urls", help="print the Router replicas' direct-ingress URLs, comma-separated")
    urls.add_argument("--log", action="append", default=[], help="the `serve run` output (repeatable; the Ray "
                      f"session's Router replica logs, {ROUTER_REPLICA_LOGS}, are always read)")
    urls.add_argument("--serve-config", help="the app's serve config (or an overlay): wait for all its Router "
                      "replicas, on its host")
    add_set_argument(urls)
    urls.add_argument("--expect", type=int, default=1, help="without --serve-config: Router replicas to wait for")
    urls.add_argument("--host", default="127.0.0.1", help="without --serve-config: the replicas' host")
    urls.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    try:
        if args.serve_config:
            serve_config = load_serve_config(args.serve_config, args.set)
            print(router_urls(serve_config, args.log, args.timeout))
        else:
            print(",".join(wait_for_urls(args.log, args.expect, args.host, args.timeout)))
    except (TimeoutError, OverlayError) as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

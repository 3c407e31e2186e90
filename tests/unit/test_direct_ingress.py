"""Direct ingress in the load generator: reading the Router replicas' ports from the logs, spreading requests over
several servers, and the --serve-config flow that starts the app with the flag and loads the replicas' ports (with a
stand-in for `serve run`; no Ray, no engine)."""

from __future__ import annotations

import json
import sys
import time

import pytest
from aiohttp import web

from load_tests import direct_ingress
from load_tests.run import run_serve_configs
from load_tests.scenario import parse_scenario
from load_tests.workload import run_scenario, split_urls
from tests.unit.test_load_report import BASE, fake_app, free_port, lanes_up

ANNOUNCE = ("(ServeReplica:llm-lanes:Router pid=1) INFO 2026-12-03 07:28:30,198 llm-lanes_Router d0cg383v -- "
            "Successfully started RequestProtocol.HTTP server on port {port}")


def test_ports_are_read_in_order_without_repeats_and_grpc_lines_are_ignored():
    log = "\n".join([ANNOUNCE.format(port=30001), "Successfully started RequestProtocol.GRPC server on port 40000",
                     ANNOUNCE.format(port=30000), ANNOUNCE.format(port=30001), "unrelated line"])
    assert direct_ingress.http_ports_from_log(log) == [30001, 30000]
    assert direct_ingress.http_ports_from_log("") == []


def test_router_replicas_and_host_come_from_the_serve_config():
    config = {"http_options": {"host": "0.0.0.0"},
              "applications": [{"import_path": "app.main:build_app", "args": {"router": {"num_replicas": 4}}}]}
    assert direct_ingress.router_replicas(config) == 4 and direct_ingress.http_host(config) == "127.0.0.1"
    config = {"http_options": {"host": "10.0.0.5"}, "applications": [{"import_path": "app.main:build_app"}]}
    assert direct_ingress.router_replicas(config) == 1 and direct_ingress.http_host(config) == "10.0.0.5"


def test_wait_for_urls_returns_once_enough_replicas_announced(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text(ANNOUNCE.format(port=30000) + "\n" + ANNOUNCE.format(port=30002) + "\n")
    urls = direct_ingress.wait_for_urls([log], 2, "127.0.0.1", timeout_s=1, session_logs=None)
    assert urls == ["http://127.0.0.1:30000", "http://127.0.0.1:30002"]
    # Glob patterns work too (the Ray session's replica logs are found that way).
    assert direct_ingress.wait_for_urls([str(tmp_path / "*.log")], 1, timeout_s=1, session_logs=None) == urls[:1]


def test_wait_for_urls_times_out_with_a_message_naming_the_flag(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text(ANNOUNCE.format(port=30000))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="1 of 2 Router replicas.*RAY_SERVE_ENABLE_DIRECT_INGRESS=1"):
        direct_ingress.wait_for_urls([log], 2, timeout_s=0.3, poll_s=0.05, session_logs=None)
    assert time.monotonic() - started < 5


def test_silent_router_replicas_are_found_through_the_controllers_allocations(tmp_path):
    # RAY_SERVE_THROUGHPUT_OPTIMIZED=1 buffers replica log lines: the Router logs exist but announce nothing yet.
    serve = tmp_path / "serve"
    serve.mkdir()
    for replica in ("abc123", "def456"):
        (serve / f"replica_llm-lanes_Router_{replica}.log").write_text("")
    (serve / "replica_llm-lanes_HotLane_zzz999.log").write_text("")
    (serve / "controller_1.log").write_text(
        "Allocated RequestProtocol.HTTP port 30000 to replica abc123 on node n1\n"
        "Allocated RequestProtocol.HTTP port 30005 to replica zzz999 on node n1\n"  # not a Router: ignored
        "Allocated RequestProtocol.HTTP port 30001 to replica def456 on node n1\n"
        "Allocated RequestProtocol.HTTP port 30003 to replica abc123 on node n1\n")  # restarted: the latest counts
    urls = direct_ingress.wait_for_urls([], 2, timeout_s=1, session_logs=str(serve / "replica_*_Router_*.log"),
                                        controller_logs=str(serve / "controller_*.log"))
    assert urls == ["http://127.0.0.1:30003", "http://127.0.0.1:30001"]


def test_cli_prints_comma_separated_urls(tmp_path, capsys):
    log = tmp_path / "serve.log"
    log.write_text(ANNOUNCE.format(port=30000) + "\n" + ANNOUNCE.format(port=30001))
    # --log's ports come before those of the Ray session's own logs (which a developer machine may have).
    assert direct_ingress.main(["urls", "--log", str(log), "--expect", "2", "--timeout", "1"]) == 0
    assert capsys.readouterr().out.strip() == "http://127.0.0.1:30000,http://127.0.0.1:30001"


def test_cli_waits_for_every_router_replica_of_a_serve_config(tmp_path, capsys):
    config = tmp_path / "lanes.yaml"
    config.write_text("http_options: {host: 0.0.0.0}\napplications:\n  - import_path: app.main:build_app\n"
                      "    args: {router: {num_replicas: 2}}\n")
    log = tmp_path / "serve.log"
    log.write_text(ANNOUNCE.format(port=30000) + "\n" + ANNOUNCE.format(port=30001))
    assert direct_ingress.main(["urls", "--serve-config", str(config), "--log", str(log), "--timeout", "1"]) == 0
    assert capsys.readouterr().out.strip() == "http://127.0.0.1:30000,http://127.0.0.1:30001"


def test_split_urls():
    assert split_urls("http://a:1/, http://b:2") == ["http://a:1", "http://b:2"]
    assert split_urls("http://a:1") == ["http://a:1"]
    with pytest.raises(ValueError):
        split_urls(" , ")


async def _start(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def test_requests_are_spread_round_robin_over_several_servers():
    seen_a: list[dict] = []
    seen_b: list[dict] = []
    runner_a, port_a = await _start(fake_app(0.001, seen_a))
    runner_b, port_b = await _start(fake_app(0.001, seen_b))
    try:
        data = json.loads(json.dumps(BASE))
        data["streams"] = data["streams"][:2]  # 5 interactive + 3 batch, all answered
        records, _ = await run_scenario(parse_scenario(data), f"http://127.0.0.1:{port_a},http://127.0.0.1:{port_b}")
    finally:
        await runner_a.cleanup()
        await runner_b.cleanup()
    assert len(records) == 8 and all(r.ok for r in records)
    warmup = parse_scenario(data).warmup_requests
    assert len(seen_a) + len(seen_b) == 8 + max(warmup, 2 if warmup else 0)
    assert abs(len(seen_a) - len(seen_b)) <= 1  # round robin


def serve_direct_ingress_stand_in(proxy_port: int, replica_port: int) -> None:
    """A stand-in for `serve run` under direct ingress: the 'proxy' port is ready but fails every completion; the
    'replica' port (announced in the log only when the flag is set, as Ray does) serves them."""
    import asyncio
    import os

    async def main() -> None:
        proxy = web.Application()

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": []})

        async def refuse(_: web.Request) -> web.Response:
            return web.json_response({"error": {"message": "went through the proxy"}}, status=500)

        proxy.router.add_get("/v1/models", models)
        proxy.router.add_get("/v1/admin/stats", lanes_up)
        proxy.router.add_post("/v1/chat/completions", refuse)
        proxy.router.add_post("/v1/completions", refuse)
        # Announced before the proxy answers, so the announcement is in the log by the time the app is ready.
        if os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1":
            print(ANNOUNCE.format(port=replica_port), flush=True)
        for app, port in ((fake_app(0.001), replica_port), (proxy, proxy_port)):
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.sleep(3600)

    asyncio.run(main())


def test_serve_config_flow_loads_the_replica_ports_not_the_proxy(tmp_path):
    proxy_port, replica_port = free_port(), free_port()
    config = tmp_path / "lanes.yaml"
    config.write_text("http_options: {host: 127.0.0.1}\napplications:\n  - import_path: app.main:build_app\n")
    data = json.loads(json.dumps(BASE))
    data["streams"] = data["streams"][:2]
    code = (f"from tests.unit.test_direct_ingress import serve_direct_ingress_stand_in; "
            f"serve_direct_ingress_stand_in({proxy_port}, {replica_port})")
    runs = run_serve_configs(
        parse_scenario(data), [str(config)], f"http://127.0.0.1:{proxy_port}", tmp_path, 30, False,
        start_command_for=lambda _: [sys.executable, "-c", code], stop_commands=[], cleanup_commands=[],
        poll_interval_s=0.1, use_direct_ingress=True,
    )
    assert [r.label for r in runs] == ["lanes-direct-ingress"] and runs[0].error is None
    assert len(runs[0].records) == 8 and all(r.ok for r in runs[0].records)


def test_many_outstanding_requests_are_spread_over_several_clients_per_server():
    from load_tests.workload import REQUESTS_PER_CLIENT, ClientPool, peak_outstanding

    sizes = {"prompt_tokens": 8, "max_tokens": 1}
    scenario = parse_scenario({"name": "s", "model": "m", "streams": [
        {"name": "batch", "arrival": {"type": "closed", "concurrency": 256}, "duration_s": 1, **sizes},
        {"name": "burst", "arrival": {"type": "burst", "n": 20, "at_s": 0}, **sizes},
        {"name": "chat", "arrival": {"type": "poisson", "rate": 1.5}, "duration_s": 1, **sizes}]})
    assert peak_outstanding(scenario) == 256 + 20 + 2
    assert REQUESTS_PER_CLIENT == 32
    pool = ClientPool("http://a:1,http://b:2", clients_per_server=3)
    urls = [str(pool.next().base_url) for _ in range(6)]
    # Round robin over every client, alternating servers: each server gets half the requests.
    assert len(pool.clients) == 6 and len({id(pool.next()) for _ in range(6)}) == 6
    assert sorted(urls) == ["http://a:1", "http://a:1", "http://a:1", "http://b:2", "http://b:2", "http://b:2"]
    with pytest.raises(ValueError, match="clients_per_server"):
        ClientPool("http://a:1", clients_per_server=0)

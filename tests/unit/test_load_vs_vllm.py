"""load_tests.vs_vllm's pure parts: the server gets the app's own engine arguments as flags, and the report's
ratios compare each app target with the server that ran its engine arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from load_tests import vs_vllm
from load_tests.overlay import load_serve_config
from load_tests.vs_vllm import engine_cli_args, ratios, render_markdown, server_engine, summarize


def test_engine_arguments_become_the_servers_flags():
    flags = engine_cli_args({"model": "m", "enforce_eager": True, "enable_prefix_caching": False, "tokenizer": None,
                             "max_num_seqs": 32, "compilation_config": {"level": 0}})
    assert flags == ["--model", "m", "--enforce-eager", "--no-enable-prefix-caching", "--max-num-seqs", "32",
                     "--compilation-config", '{"level": 0}']


def test_the_server_runs_the_hot_lanes_engine_with_its_cpu_binding():
    engine_args, env = server_engine(load_serve_config("serve_configs/local.yaml"))
    assert engine_args["max_num_seqs"] == 32 and engine_args["dtype"] == "float32"
    assert engine_args["served_model_name"] == "tiny-llama" and "disable_log_stats" not in engine_args
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": "0"}


def _run(ttft: float, p99: float, tpot: float) -> dict:
    return {"median_ttft_ms": ttft, "p99_ttft_ms": p99, "median_tpot_ms": tpot, "median_itl_ms": 1.0,
            "median_e2el_ms": 100.0, "output_throughput": 200.0, "completed": 64, "failed": 0}


def test_ratios_are_medians_over_the_servers_medians_and_the_report_judges_the_targets():
    server = summarize([_run(10, 30, 3), _run(14, 40, 3)])
    app = summarize([_run(15, 60, 3.3), _run(17, 50, 3.6)])
    assert server["median_ttft_ms"] == 12 and server["completed"] == 128
    assert ratios(app, server)["median_ttft_ms"] == 16 / 12
    report = {"settings": {"input_len": 128, "output_len": 32, "num_prompts": 64, "request_rate": 8, "runs": 2},
              "when": "now", "autogroup": False,
              "targets": [{"name": "vllm-server-1", "config": "serve_configs/local.yaml", "server_flags": ["--x"],
                           "runs": [_run(10, 30, 3)], "summary": server},
                          {"name": "app-1-local", "config": "serve_configs/local.yaml", "runs": [_run(15, 60, 3.3)],
                           "summary": app, "compared_with": "vllm-server-1", "ratios": ratios(app, server)}]}
    markdown = render_markdown(report)
    assert "| app-1-local ÷ vllm-server-1 | 1.33 (≤ 2.0: yes) | 1.57 (≤ 2.0: yes) |" in markdown
    assert "saturation" not in markdown  # no saturation run, no table


def test_saturation_requests_per_second_are_reported_over_the_server_and_ray_serve_llm():
    def saturated(rps: float) -> dict:
        return vs_vllm.saturation_figures({"request_throughput": rps, "output_throughput": 32 * rps,
                                           "completed": 128, "failed": 0}, 16)

    run = _run(10, 30, 3)
    targets = [{"name": "vllm-server-1", "config": "c", "server_flags": [], "runs": [run], "summary": summarize([run]),
                "saturation": saturated(40.0)},
               {"name": "serve-llm", "config": "c", "llm_config": {}, "runs": [run], "summary": summarize([run]),
                "saturation": saturated(20.0)},
               {"name": "app-1-baseline-local", "config": "c", "runs": [run], "summary": summarize([run]),
                "compared_with": "vllm-server-1", "compared_with_serve_llm": "serve-llm",
                "saturation": saturated(25.0)}]
    report = {"settings": {"input_len": 128, "output_len": 32, "num_prompts": 64, "request_rate": 8, "runs": 1},
              "when": "now", "autogroup": False, "targets": targets}
    markdown = render_markdown(report)
    assert "Requests/s at saturation (every request sent at once, 16 in flight" in markdown
    assert "| vllm-server-1 | 40.0 | 1280 | 128 / 0 | – | – |" in markdown
    assert "| app-1-baseline-local | 25.0 | 800 | 128 / 0 | 0.62 | 1.25 |" in markdown


def test_the_saturation_run_is_a_closed_loop_of_every_request_at_once():
    import argparse

    args = argparse.Namespace(input_len=128, output_len=32, num_prompts=128, request_rate="inf", seed=0)
    command = vs_vllm.bench_command("http://x", "m", "t", args, Path("/tmp"), "r.json", seed=0, max_concurrency=16)
    assert command[command.index("--request-rate") + 1] == "inf"
    assert command[command.index("--max-concurrency") + 1] == "16"
    assert "--max-concurrency" not in vs_vllm.bench_command("http://x", "m", "t", args, Path("/tmp"), "r.json", 0)


def test_top_functions_ranks_own_samples_and_merges_lines():
    from load_tests.vs_vllm import top_functions

    collapsed = "\n".join([
        "main (a/b/c/app.py:1);handle (app/router/http_api.py:40);encode (json/encoder.py:200) 6",
        "main (a/b/c/app.py:1);handle (app/router/http_api.py:41) 3",
        "main (a/b/c/app.py:1) 1",
        "not a line",
    ])
    ranked = top_functions(collapsed, top=2)
    assert ranked == [("encode (json/encoder.py)", 0.6, 0.6), ("handle (app/router/http_api.py)", 0.3, 0.9)]


def test_direct_ingress_is_refused_for_more_than_one_router_replica(tmp_path, capsys):
    # vllm bench serve sends to one URL, and each Router replica has its own port under direct ingress.
    document = yaml.safe_load((Path(__file__).resolve().parents[2] / "serve_configs" / "local.yaml").read_text())
    document["applications"][0]["args"]["router"]["num_replicas"] = 2
    config = tmp_path / "two-routers.yaml"
    config.write_text(yaml.safe_dump(document))
    with pytest.raises(SystemExit) as exited:
        vs_vllm.main(["--serve-config", str(config), "--out", str(tmp_path / "out"), "--direct-ingress"])
    assert exited.value.code == 2
    assert "--direct-ingress needs one Router replica; " in capsys.readouterr().err

"""load_tests.serve_llm's pure parts and vs_vllm's Ray Serve LLM target: the LLMConfig carries the hot lane's engine
arguments on CPU, its serve config keeps the app's proxy, and only an app on the same engine is compared with it."""

from __future__ import annotations

import argparse

from load_tests import serve_llm, vs_vllm_report
from load_tests.overlay import load_serve_config
from load_tests.vs_vllm import plan_targets, ratios, render_markdown, server_engine, summarize


def test_the_llm_config_serves_the_hot_lanes_engine_on_cpu(tmp_path):
    (tmp_path / "models" / "tiny-llama").mkdir(parents=True)
    engine_args, env = server_engine(load_serve_config("serve_configs/baseline-local.yaml"))
    config = serve_llm.llm_config(engine_args, env, base=tmp_path, replica_cpus=1)
    model = str(tmp_path / "models" / "tiny-llama")
    # Ray Serve LLM refuses model and served_model_name among the engine's arguments: they come from here.
    assert config["model_loading_config"] == {"model_id": "tiny-llama", "model_source": model}
    assert "model" not in config["engine_kwargs"] and "served_model_name" not in config["engine_kwargs"]
    assert config["engine_kwargs"]["tokenizer"] == model
    rest = {key: value for key, value in engine_args.items() if key not in ("model", "served_model_name", "tokenizer")}
    assert {key: config["engine_kwargs"][key] for key in rest} == rest
    assert config["accelerator_config"] == {"kind": "cpu"}
    assert config["deployment_config"] == {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}
    assert config["runtime_env"] == {"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}}


def test_a_model_that_is_no_local_folder_is_passed_as_given(tmp_path):
    config = serve_llm.llm_config({"model": "org/model", "tokenizer": None, "dtype": "float32"}, {}, base=tmp_path)
    assert config["model_loading_config"] == {"model_id": "org/model", "model_source": "org/model"}
    assert config["engine_kwargs"] == {"dtype": "float32"} and "runtime_env" not in config
    assert config["deployment_config"] == {"num_replicas": 1}  # Ray Serve LLM's own reservation


def test_the_serve_config_keeps_the_apps_proxy_and_serve_settings_and_nothing_of_the_app():
    document = load_serve_config("serve_configs/baseline-local.yaml")
    config = {"model_loading_config": {"model_id": "tiny-llama"}}
    served = serve_llm.serve_llm_document(document, config, ingress_cpus=0)
    assert served["http_options"] == document["http_options"] and served["proxy_location"] == "HeadOnly"
    assert "grpc_options" not in served  # the app's gRPC servicers live in its own code
    (application,) = served["applications"]
    assert application["import_path"] == "ray.serve.llm:build_openai_app" and application["route_prefix"] == "/"
    # The ingress reserves what the app's Router does: Serve's default of 1 CPU beside the engine replica's 2 would
    # not fit a 2-core host.
    assert application["args"] == {"llm_configs": [config],
                                   "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}}
    assert serve_llm.app_reservations(document) == (0, 1)
    assert "ingress_deployment_config" not in serve_llm.serve_llm_document(document, config)["applications"][0]["args"]
    assert application["runtime_env"] == {"env_vars": document["applications"][0]["runtime_env"]["env_vars"]}


def _args(tmp_path, *configs, **options) -> argparse.Namespace:
    return argparse.Namespace(serve_config=list(configs), out=str(tmp_path), serve_llm=options.get("serve_llm"),
                              haproxy=options.get("haproxy", False), direct_ingress=options.get("haproxy", False))


def test_ray_serve_llm_runs_after_the_first_server_and_only_the_same_engine_is_compared_with_it(tmp_path):
    plan = plan_targets(_args(tmp_path, "serve_configs/baseline-local.yaml", "serve_configs/local.yaml",
                              serve_llm="/venv/bin/python"), tmp_path)
    assert [step["name"] for step in plan] == ["vllm-server-1", "serve-llm-1", "app-1-baseline-local",
                                               "vllm-server-2", "app-2-local"]
    assert plan[2]["compared_with_serve_llm"] == "serve-llm-1" and "compared_with_serve_llm" not in plan[4]
    assert plan[1]["serve_llm"]["applications"][0]["args"]["llm_configs"] == [plan[1]["llm_config"]]
    assert plan[1]["llm_config"]["deployment_config"]["ray_actor_options"] == {"num_cpus": 1}
    without = plan_targets(_args(tmp_path, "serve_configs/baseline-local.yaml"), tmp_path)
    assert [step["name"] for step in without] == ["vllm-server-1", "app-1-baseline-local"]
    assert "compared_with_serve_llm" not in without[1]
    behind_haproxy = plan_targets(_args(tmp_path, "serve_configs/baseline-local.yaml", serve_llm="python",
                                        haproxy=True), tmp_path)
    assert behind_haproxy[2]["compared_with_serve_llm"] == "serve-llm-1-haproxy"


def _run(ttft: float, p99: float, tpot: float) -> dict:
    return {"median_ttft_ms": ttft, "p99_ttft_ms": p99, "median_tpot_ms": tpot, "median_itl_ms": 1.0,
            "median_e2el_ms": 100.0, "output_throughput": 200.0, "completed": 64, "failed": 0}


def test_the_report_judges_the_app_against_ray_serve_llm():
    server, llm, app = (summarize([_run(*figures)]) for figures in ((10, 20, 3), (40, 80, 6), (36, 88, 6)))
    config = "serve_configs/baseline-local.yaml"
    report = {"settings": {"input_len": 128, "output_len": 32, "num_prompts": 64, "request_rate": 8, "runs": 1},
              "when": "now", "autogroup": False,
              "targets": [{"name": "vllm-server-1", "config": config, "server_flags": ["--x"],
                           "runs": [_run(10, 20, 3)], "summary": server},
                          {"name": "serve-llm-1", "config": config, "llm_config": {"engine_kwargs": {"dtype": "f"}},
                           "runs": [_run(40, 80, 6)], "summary": llm},
                          {"name": "app-1-baseline-local", "config": config, "runs": [_run(36, 88, 6)],
                           "summary": app, "compared_with": "vllm-server-1", "ratios": ratios(app, server),
                           "compared_with_serve_llm": "serve-llm-1", "ratios_serve_llm": ratios(app, llm)}]}
    markdown = render_markdown(report)
    assert '- serve-llm-1: Ray Serve LLM\'s OpenAI app, `LLMConfig` `{"engine_kwargs": {"dtype": "f"}}`' in markdown
    assert ("| app-1-baseline-local ÷ serve-llm-1 | 0.90 (≤ 1.0: yes) | 1.10 (≤ 1.0: no) | 1.00 (≤ 1.0: yes) | "
            "1.00 | 1.00 |") in markdown
    assert "| app-1-baseline-local ÷ vllm-server-1 | 3.60 (≤ 1.2: no) |" in markdown
    report["targets"][2].pop("ratios_serve_llm")
    assert "Ray Serve LLM on the same engine" not in render_markdown(report)


def test_serve_llm_runs_under_the_interpreter_given():
    assert serve_llm.start_command("/v/bin/python", "c.yaml") == ["/v/bin/python", "-m", "ray.serve.scripts", "run",
                                                                  "c.yaml"]
    assert vs_vllm_report.SERVE_LLM_TARGETS["baseline-local.yaml"] == {"median_ttft_ms": 1.0, "p99_ttft_ms": 1.0,
                                                                       "median_tpot_ms": 1.0}

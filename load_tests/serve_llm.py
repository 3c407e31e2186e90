"""Ray Serve LLM's OpenAI app (`ray.serve.llm.build_openai_app`) on the engine arguments of an app config's hot lane,
as a target of load_tests/vs_vllm.py.

The target is a serve config of its own: Ray Serve LLM's builder as the import path (`ray.serve.llm:build_openai_app`,
unmodified), one `LLMConfig` as its args, the app config's `proxy_location` and `http_options` (the same Serve proxy
on the same port), and the app's application `runtime_env` env vars (Serve's replica-side throughput settings), so the
two differ in what runs behind the proxy and nothing else. It is started with `serve run` under another interpreter
(`--serve-llm PYTHON`): Ray Serve LLM imports packages the project's environment lacks (docs/benchmarks.md says which
and how to add them beside it). `serve run` starts the local Ray cluster with its own interpreter, so Ray's workers
(the replicas) get those packages too.

The `LLMConfig`:
- `model_loading_config`: `model_id` is the served name, `model_source` the model folder; Ray Serve LLM refuses
  `model` and `served_model_name` in `engine_kwargs` and sets them from these.
- `engine_kwargs`: every other engine argument as the app gives it to vLLM (`app.lanes.engine.engine_args_dict`);
  local paths made absolute, since the replicas need not run in this directory.
- `accelerator_config: {kind: cpu}`: without it (and without a placement group config of CPU-only bundles) Ray
  Serve LLM assumes a GPU, asks for one in its placement group and runs vLLM's Ray executor; on CPU it runs vLLM's
  multiprocessing executor and asks for `{CPU: 1}` per device, added to the replica's own CPU.
- `deployment_config`: one replica, reserving the CPUs of the app's hot-lane replica (`num_cpus`); Ray Serve LLM's
  placement group adds the engine's `{CPU: 1}` to it.
- `ingress_deployment_config` (beside the LLMConfig): the ingress reserves the CPUs of the app's Router replica.
  Serve's default (1) beside the engine replica's group (2 on `baseline-local.yaml`) would ask 3 CPUs of a 2-core
  host's 2, and the engine replica would never be placed.
- `runtime_env.env_vars`: the lane's CPU binding (VLLM_CPU_OMP_THREADS_BIND), which the engine process inherits.

Whether an environment can run it, without starting Ray (under that environment's interpreter, from the checkout):

    PYTHON -m load_tests.vs_vllm check-serve-llm --serve-config serve_configs/baseline-local.yaml

imports `ray.serve.llm`, builds the `LLMConfig` and the app object (`build_openai_app`), then what the replica does
before it starts the engine: the vLLM engine arguments and `VllmConfig` (Ray Serve LLM's `_get_vllm_engine_config`)
and the vLLM modules its engine wrapper imports when it starts. Each step prints ok or the error with its traceback.
"""

from __future__ import annotations

import copy
import time
import traceback
from pathlib import Path
from typing import Any

import httpx

APPLICATION_NAME = "serve-llm"
IMPORT_PATH = "ray.serve.llm:build_openai_app"
# Engine arguments that name local files: made absolute so a replica finds them whatever its working directory.
PATH_ARGUMENTS = ("model", "tokenizer")
ANSWER_POLL_INTERVAL_S = 2.0
# What Ray Serve LLM's vLLM engine wrapper imports from vLLM when a replica starts the engine (inside its functions,
# so importing the wrapper alone does not show them).
ENGINE_IMPORTS = (("vllm.entrypoints.openai.api_server", "build_app"),
                  ("vllm.entrypoints.openai.api_server", "init_app_state"),
                  ("vllm.v1.engine.async_llm", "AsyncLLM"),
                  ("vllm.v1.executor.abstract", "Executor"),
                  ("vllm.v1.metrics.ray_wrappers", "RayPrometheusStatLogger"),
                  ("vllm.entrypoints.serve.lora.protocol", "LoadLoRAAdapterRequest"))


def _absolute_if_local(value: str, base: Path) -> str:
    path = Path(value) if Path(value).is_absolute() else base / value
    return str(path.resolve()) if path.exists() else value


def app_reservations(app_document: dict[str, Any]) -> tuple[float, float]:
    """The CPUs the app's serve config reserves for its Router replica and for its hot-lane replica."""
    from app.config import AppConfig
    from load_tests.overlay import llm_lanes_application

    cfg = AppConfig.model_validate(llm_lanes_application(app_document).get("args") or {})
    return cfg.router.num_cpus, cfg.hot_lane.deployment.num_cpus


def llm_config(engine_args: dict[str, Any], env: dict[str, str], base: Path | None = None,
               replica_cpus: float | None = None) -> dict[str, Any]:
    """The LLMConfig (as a dictionary `LLMConfig(**it)` takes) that serves these vLLM engine arguments on CPU."""
    base = base or Path.cwd()
    kwargs = {key: value for key, value in engine_args.items() if value is not None}
    for key in PATH_ARGUMENTS:
        if isinstance(kwargs.get(key), str):
            kwargs[key] = _absolute_if_local(kwargs[key], base)
    model_source = kwargs.pop("model")
    served = kwargs.pop("served_model_name", None) or model_source
    if isinstance(served, list):
        served = served[0]
    config: dict[str, Any] = {
        "model_loading_config": {"model_id": served, "model_source": model_source},
        "engine_kwargs": kwargs,
        "accelerator_config": {"kind": "cpu"},
        "deployment_config": {"num_replicas": 1},
    }
    if replica_cpus is not None:
        config["deployment_config"]["ray_actor_options"] = {"num_cpus": replica_cpus}
    if env:
        config["runtime_env"] = {"env_vars": dict(env)}
    return config


def serve_llm_document(app_document: dict[str, Any], config: dict[str, Any],
                       ingress_cpus: float | None = None) -> dict[str, Any]:
    """A serve config that runs Ray Serve LLM's OpenAI app on `config` behind the app config's proxy settings."""
    from load_tests.overlay import llm_lanes_application

    document = {key: copy.deepcopy(app_document[key]) for key in ("proxy_location", "http_options")
                if key in app_document}
    application: dict[str, Any] = {"name": APPLICATION_NAME, "route_prefix": "/", "import_path": IMPORT_PATH}
    env_vars = ((llm_lanes_application(app_document).get("runtime_env") or {}).get("env_vars") or {})
    if env_vars:
        application["runtime_env"] = {"env_vars": copy.deepcopy(env_vars)}
    application["args"] = {"llm_configs": [copy.deepcopy(config)]}
    if ingress_cpus is not None:
        application["args"]["ingress_deployment_config"] = {"ray_actor_options": {"num_cpus": ingress_cpus}}
    document["applications"] = [application]
    return document


def start_command(python: str, serve_config: str) -> list[str]:
    """`serve run` under the interpreter that has Ray Serve LLM's packages (that environment has no `serve` script
    when it is a bare venv on top of the project's packages)."""
    return [python, "-m", "ray.serve.scripts", "run", serve_config]


def stop_commands(python: str) -> list[list[str]]:
    return [[python, "-m", "ray.serve.scripts", "shutdown", "-y"]]


def cleanup_commands(python: str) -> list[list[str]]:
    return [[python, "-m", "ray.scripts.scripts", "stop", "--force"]]


def wait_answering(url: str, model: str, timeout_s: float) -> float:
    """Seconds until one chat completion answers 200. Ray Serve LLM's ingress lists its models before the engine
    behind it is up, so /v1/models answering says nothing about the engine."""
    began = time.monotonic()
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with httpx.Client(timeout=60.0) as client:
        while True:
            try:
                if client.post(url.rstrip("/") + "/v1/chat/completions", json=body).status_code == 200:
                    return time.monotonic() - began
            except httpx.HTTPError:
                pass
            if time.monotonic() - began > timeout_s:
                raise TimeoutError(f"{url}: no chat completion answered 200 within {timeout_s} s")
            time.sleep(ANSWER_POLL_INTERVAL_S)


def _refuse_to_start_ray(*_args: Any, **_kwargs: Any) -> None:
    raise RuntimeError("this check runs without Ray: a step tried to start or connect to it")


def check(builder_args: dict[str, Any]) -> int:
    """The steps of Ray Serve LLM's start-up that need no Ray, for the builder's args (`llm_configs` of one LLMConfig
    as a dictionary, and the ingress's options), each reported ok or with its error; 1 if any failed."""
    import importlib

    import ray
    import ray._private.worker

    ray.init = ray._private.worker.init = _refuse_to_start_ray
    print(f"build_openai_app's args: {builder_args}", flush=True)
    state: dict[str, Any] = {}

    def build_config() -> None:
        from ray.serve.llm import LLMConfig

        state["config"] = LLMConfig(**builder_args["llm_configs"][0])

    def build_app() -> None:
        from types import SimpleNamespace

        from ray.serve.llm import build_openai_app

        # The builder reads the driver's runtime_env from Ray's runtime context, which starts Ray when it is not
        # running (under `serve run` it is): an empty one, as a driver without a runtime_env has, stands in for it.
        real_context, ray.get_runtime_context = ray.get_runtime_context, lambda: SimpleNamespace(runtime_env={})
        try:
            state["app"] = build_openai_app({**builder_args, "llm_configs": [state["config"]]})
        finally:
            ray.get_runtime_context = real_context

    def engine_config() -> None:
        from ray.llm._internal.serve.engines.vllm.vllm_engine import _get_vllm_engine_config

        engine_args, vllm_config = _get_vllm_engine_config(state["config"])
        print(f"  executor: {engine_args.distributed_executor_backend}, device: {vllm_config.device_config.device}",
              flush=True)

    steps = [("from ray.serve.llm import LLMConfig, build_openai_app",
              lambda: importlib.import_module("ray.serve.llm")),
             ("LLMConfig(**llm_configs[0])", build_config),
             ("build_openai_app(args) (Ray's runtime context stubbed)", build_app),
             ("_get_vllm_engine_config(config) (AsyncEngineArgs, VllmConfig)", engine_config)]
    steps += [(f"from {module} import {name}", lambda module=module, name=name: getattr(
        importlib.import_module(module), name)) for module, name in ENGINE_IMPORTS]
    failed = 0
    for label, step in steps:
        try:
            step()
            print(f"ok: {label}", flush=True)
        except Exception:  # every failure is the finding, whatever its type
            failed += 1
            print(f"FAILED: {label}\n{traceback.format_exc()}", flush=True)
    return 1 if failed else 0

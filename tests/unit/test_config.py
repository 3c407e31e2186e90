"""Config schema rules: each rule fails with a message that names the field and the fix."""

import os
import threading
from pathlib import Path

import pytest
import yaml

from app.config import AppConfig, ConfigError, load_app_config, placement_group_bundles
from app.lanes.engine import engine_args_dict
from app.main import lane_deployment_options

REPO = Path(__file__).resolve().parents[2]
# The shipped configs; the overlays under load_tests/configs are merged and validated in test_config_overlays.py.
SERVE_CONFIGS = sorted(REPO.glob("serve_configs/*.yaml"))


def cpu_args(**overrides):
    lane = {"engine": {"kv_cache_memory_bytes": 1 << 28, "dtype": "float32"}, "deployment": {}}
    args = {
        "device": "cpu",
        "model": {"source": "models/tiny-llama", "served_name": "tiny", "max_model_len": 2048},
        "hot_lane": yaml.safe_load(yaml.safe_dump(lane)),
        "cold_lane": yaml.safe_load(yaml.safe_dump(lane)),
    }
    for dotted, value in overrides.items():
        node = args
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return args


def gpu_args(**overrides):
    args = cpu_args(**overrides)
    args["device"] = "gpu"
    for lane in ("hot_lane", "cold_lane"):
        args[lane]["deployment"].setdefault("num_gpus", 0.5)
    return args


def error_of(args) -> str:
    with pytest.raises(ConfigError) as caught:
        load_app_config(args)
    return str(caught.value)


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_every_serve_config_validates(path):
    document = yaml.safe_load(path.read_text())
    for application in document["applications"]:
        assert application["import_path"] == "app.main:build_app"
        cfg = load_app_config(application["args"])
        assert cfg.model.served_name


def test_defaults_follow_the_tuning_guide():
    cfg = load_app_config(gpu_args())
    assert cfg.prefix_cache.match_threshold == 0.85
    assert cfg.prefix_cache.min_prefix_tokens == 1024
    assert cfg.pinned_prefix_limit == cfg.total_gpus * 4 == 4


@pytest.mark.parametrize("block_size", [8, 48, 256])
def test_block_size_must_be_an_allowed_power_of_two(block_size):
    message = error_of(gpu_args(**{"hot_lane.engine.block_size": block_size}))
    assert "hot_lane.engine" in message and f"block_size={block_size}" in message and "[16, 32, 64, 128]" in message


def test_block_size_16_is_refused_on_cpu_only():
    assert load_app_config(gpu_args(**{"hot_lane.engine.block_size": 16, "model.max_model_len": 2048}))
    message = error_of(cpu_args(**{"cold_lane.engine.block_size": 16}))
    assert "cold_lane.engine.block_size=16" in message and "multiple of 32" in message


def test_max_model_len_must_be_a_multiple_of_block_size():
    message = error_of(cpu_args(**{"model.max_model_len": 2000}))
    assert "model.max_model_len=2000" in message and "block_size=32" in message and "divisible" in message


@pytest.mark.parametrize("utilization", [0, -0.1, 0.96, 1.5])
def test_gpu_memory_utilization_range(utilization):
    message = error_of(gpu_args(**{"cold_lane.engine.gpu_memory_utilization": utilization}))
    assert "cold_lane.engine" in message and "gpu_memory_utilization" in message and "(0, 0.95]" in message


def test_batched_tokens_must_cover_max_num_seqs():
    message = error_of(cpu_args(**{"hot_lane.engine.max_num_seqs": 512,
                                   "hot_lane.engine.max_num_batched_tokens": 256}))
    assert "max_num_batched_tokens=256 < max_num_seqs=512" in message and "raise max_num_batched_tokens" in message


def test_tensor_parallel_size_must_be_positive():
    message = error_of(gpu_args(**{"hot_lane.engine.tensor_parallel_size": 0}))
    assert "hot_lane.engine.tensor_parallel_size" in message


def test_tp_pair_gets_strict_pack_bundles():
    cfg = load_app_config(gpu_args(**{"hot_lane.engine.tensor_parallel_size": 2,
                                      "hot_lane.deployment.num_gpus": 0,
                                      "hot_lane.deployment.num_cpus": 1,
                                      "batch.single_node": True}))
    assert placement_group_bundles(cfg.hot_lane) == [{"GPU": 1, "CPU": 1}, {"GPU": 1}]
    options = lane_deployment_options(cfg.hot_lane)
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"]["num_gpus"] == 0
    assert engine_args_dict(cfg, cfg.hot_lane.engine)["distributed_executor_backend"] == "ray"


def test_tp_contradicting_gpu_count_is_refused():
    message = error_of(gpu_args(**{"hot_lane.engine.tensor_parallel_size": 2, "hot_lane.deployment.num_gpus": 1}))
    assert "num_gpus=1" in message and "tensor_parallel_size=2" in message and "leave num_gpus at 0" in message


def test_gpu_lane_without_gpu_is_refused():
    args = gpu_args()
    args["cold_lane"]["deployment"]["num_gpus"] = 0
    assert "cold_lane.deployment.num_gpus must be > 0" in error_of(args)


def test_cpu_needs_kv_cache_memory_bytes():
    args = cpu_args()
    del args["hot_lane"]["engine"]["kv_cache_memory_bytes"]
    assert "hot_lane.engine.kv_cache_memory_bytes is required on CPU" in error_of(args)


def test_unknown_keys_are_rejected_with_their_path():
    message = error_of(cpu_args(**{"hot_lane.engine.max_num_seq": 4}))
    assert "hot_lane.engine.max_num_seq: unknown key" in message
    assert "unknown key" in error_of(cpu_args(**{"routr": {}}))


def test_health_check_period_must_be_under_five_seconds():
    message = error_of(cpu_args(**{"hot_lane.deployment.health_check_period_s": 10}))
    assert "health_check_period_s=10" in message and "less than 5" in message


def test_match_threshold_range():
    assert "match_threshold=1.5" in error_of(cpu_args(**{"prefix_cache.match_threshold": 1.5}))
    assert "match_threshold=0" in error_of(cpu_args(**{"prefix_cache.match_threshold": 0}))


def test_autoscaling_bounds():
    message = error_of(cpu_args(**{"cold_lane.deployment.autoscaling": {"min_replicas": 3, "max_replicas": 2}}))
    assert "min_replicas=3 > max_replicas=2" in message


def test_extra_engine_args_cannot_shadow_fields():
    message = error_of(cpu_args(**{"hot_lane.engine.extra_engine_args": {"block_size": 64}}))
    assert "extra_engine_args repeats ['block_size']" in message


def test_engine_args_mapping_on_cpu():
    cfg = load_app_config(cpu_args(**{"hot_lane.engine.extra_engine_args": {"seed": 7}}))
    args = engine_args_dict(cfg, cfg.hot_lane.engine)
    assert args["kv_cache_memory_bytes"] == 1 << 28
    assert args["scheduling_policy"] == "priority" and args["enable_prefix_caching"] is True
    assert "gpu_memory_utilization" not in args and "distributed_executor_backend" not in args
    assert args["seed"] == 7 and args["disable_log_stats"] is False


def test_autoscaling_maps_to_serve_options():
    cfg = AppConfig.model_validate(cpu_args(**{"cold_lane.deployment.autoscaling": {"min_replicas": 1,
                                                                                      "max_replicas": 3}}))
    options = lane_deployment_options(cfg.cold_lane)
    assert options["num_replicas"] == "auto"
    assert options["autoscaling_config"]["max_replicas"] == 3


def test_lane_env_vars_reach_the_replica_runtime_env():
    cfg = load_app_config(cpu_args(**{"cold_lane.deployment.env_vars": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75"}}))
    cold = lane_deployment_options(cfg.cold_lane)["ray_actor_options"]
    assert cold["runtime_env"] == {"env_vars": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75"}}
    assert "runtime_env" not in lane_deployment_options(cfg.hot_lane)["ray_actor_options"]


def test_cpu_nice_is_a_niceness_and_stays_out_of_the_engine_args():
    message = error_of(cpu_args(**{"cold_lane.engine.cpu_nice": 25}))
    assert "cold_lane.engine.cpu_nice" in message and "19" in message
    cfg = load_app_config(cpu_args(**{"cold_lane.engine.cpu_nice": 15}))
    assert cfg.cold_lane.engine.cpu_nice == 15 and cfg.hot_lane.engine.cpu_nice == 0
    assert "cpu_nice" not in engine_args_dict(cfg, cfg.cold_lane.engine)


@pytest.mark.parametrize("setting", ["cpu_frontend_bind", "cpu_engine_core_bind"])
def test_cpu_bindings_are_cpu_lists_and_stay_out_of_the_engine_args(setting):
    message = error_of(cpu_args(**{f"cold_lane.engine.{setting}": "0;1"}))
    assert "cold_lane.engine" in message and setting in message and "CPU list" in message
    cfg = load_app_config(cpu_args(**{f"cold_lane.engine.{setting}": "0-1"}))
    assert getattr(cfg.cold_lane.engine, setting) == "0-1" and getattr(cfg.hot_lane.engine, setting) is None
    assert setting not in engine_args_dict(cfg, cfg.cold_lane.engine)


def test_placed_on_cpus_binds_the_engine_threads_and_names_a_core_the_host_lacks(monkeypatch):
    from app.lanes.engine import placed_on_cpus

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cfg = load_app_config(cpu_args(**{"hot_lane.engine.cpu_threads_bind": "0"}))
    with placed_on_cpus(cfg, cfg.hot_lane.engine):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"

    affinity = os.sched_getaffinity(0)
    for setting in ("cpu_frontend_bind", "cpu_engine_core_bind"):
        cfg = load_app_config(cpu_args(**{f"cold_lane.engine.{setting}": "4095"}))
        with pytest.raises(RuntimeError, match=rf"{setting}='4095' cannot be applied on this host"):
            with placed_on_cpus(cfg, cfg.cold_lane.engine):
                pass
        assert os.sched_getaffinity(0) == affinity  # nothing was pinned


def test_the_engine_core_spawns_on_its_own_cores_and_the_frontend_moves_on_afterwards():
    """What an engine started inside the block inherits (here: a thread started there, as a spawned process would)
    and where this process runs once the engine is up."""
    from app.lanes.cpu_priority import pin_process
    from app.lanes.engine import placed_on_cpus

    affinity = os.sched_getaffinity(0)
    first, last = min(affinity), max(affinity)
    cfg = load_app_config(cpu_args(**{"cold_lane.engine.cpu_engine_core_bind": str(last),
                                      "cold_lane.engine.cpu_frontend_bind": str(first)}))
    inherited: list[set[int]] = []
    try:
        with placed_on_cpus(cfg, cfg.cold_lane.engine):
            started = threading.Thread(target=lambda: inherited.append(os.sched_getaffinity(0)))
            started.start()
            started.join()
        assert inherited == [{last}]
        assert os.sched_getaffinity(0) == {first}

        # Without a frontend binding the process gets back the affinity it had.
        pin_process(os.getpid(), affinity)
        cfg = load_app_config(cpu_args(**{"cold_lane.engine.cpu_engine_core_bind": str(last)}))
        with placed_on_cpus(cfg, cfg.cold_lane.engine):
            assert os.sched_getaffinity(0) == {last}
        assert os.sched_getaffinity(0) == affinity
    finally:
        pin_process(os.getpid(), affinity)


def test_removed_settings_are_refused_by_name():
    for key in ("admission.hot_batch_borrow_max", "admission.drain_rate_time_constant_s",
                "batch.flex_waits_for_window"):
        assert key.split(".")[1] in error_of(cpu_args(**{key: 1}))


def test_cuda_graph_max_tokens_reaches_vllms_compilation_config_on_gpu_only():
    cfg = load_app_config(gpu_args(**{"hot_lane.engine.cuda_graph_max_tokens": 512,
                                      "hot_lane.engine.extra_engine_args": {"compilation_config": {"mode": 3}}}))
    # Merged with the rest of a compilation_config passed through extra_engine_args.
    assert engine_args_dict(cfg, cfg.hot_lane.engine)["compilation_config"] == {"mode": 3,
                                                                                "max_cudagraph_capture_size": 512}
    assert "compilation_config" not in engine_args_dict(cfg, cfg.cold_lane.engine)
    cpu = load_app_config(cpu_args(**{"hot_lane.engine.cuda_graph_max_tokens": 512}))
    assert "compilation_config" not in engine_args_dict(cpu, cpu.hot_lane.engine)


def test_cuda_graph_max_tokens_is_not_set_twice_or_with_eager():
    message = error_of(gpu_args(**{"hot_lane.engine.cuda_graph_max_tokens": 512, "hot_lane.engine.extra_engine_args":
                                   {"compilation_config": {"max_cudagraph_capture_size": 256}}}))
    assert "hot_lane.engine" in message and "keep cuda_graph_max_tokens" in message
    message = error_of(gpu_args(**{"hot_lane.engine.cuda_graph_max_tokens": 512,
                                   "hot_lane.engine.enforce_eager": True}))
    assert "enforce_eager" in message


def test_gpu_single_keeps_one_of_two_hot_replicas_for_realtime():
    args = yaml.safe_load((REPO / "serve_configs/gpu-single.yaml").read_text())["applications"][0]["args"]
    cfg = load_app_config(args)
    assert cfg.admission.realtime_reserved_hot_replicas == 1 and cfg.hot_lane.deployment.num_replicas == 2
    # The GPU's fractions add up to one GPU: two hot replicas and the cold one.
    assert 2 * cfg.hot_lane.deployment.num_gpus + cfg.cold_lane.deployment.num_gpus == 1.0




def test_lane_custom_resources_reach_ray_actor_options_and_the_first_bundle():
    cfg = load_app_config(cpu_args(**{"cold_lane.deployment.resources": {"lane_host": 1}}))
    assert lane_deployment_options(cfg.cold_lane)["ray_actor_options"]["resources"] == {"lane_host": 1}
    assert "resources" not in lane_deployment_options(cfg.hot_lane)["ray_actor_options"]
    gpu = load_app_config(gpu_args(**{"hot_lane.engine.tensor_parallel_size": 2, "hot_lane.deployment.num_gpus": 0,
                                      "hot_lane.deployment.resources": {"lane_host": 1},
                                      "batch.single_node": True}))
    assert placement_group_bundles(gpu.hot_lane)[0] == {"GPU": 1, "CPU": 1, "lane_host": 1}


def test_lane_resources_naming_cpu_or_a_negative_amount_are_refused():
    assert "set num_cpus / num_gpus instead" in error_of(cpu_args(**{"hot_lane.deployment.resources": {"CPU": 1}}))
    assert "give each custom resource an amount >= 0" in error_of(
        cpu_args(**{"hot_lane.deployment.resources": {"lane_host": -1}}))

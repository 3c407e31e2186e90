"""cluster/ manifests agree with serve_configs/prod.yaml and with the app schema, and their resources add up."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import yaml

from app.config import AppConfig, load_app_config

REPO = Path(__file__).resolve().parents[2]
PROD = REPO / "serve_configs" / "prod.yaml"
RAYSERVICE = REPO / "cluster" / "kuberay" / "rayservice.yaml"
VM_CLUSTER = REPO / "cluster" / "vm" / "ray-cluster.yaml"
REFRESH = "serve_configs/prod.yaml changed: run `python cluster/kuberay/embed_serve_config.py` to re-embed it"


def rayservice() -> dict:
    docs = [d for d in yaml.safe_load_all(RAYSERVICE.read_text()) if d]
    [service] = [d for d in docs if d.get("kind") == "RayService"]
    return service


def embedded_text() -> str:
    return rayservice()["spec"]["serveConfigV2"]


def prod_app() -> AppConfig:
    return load_app_config(yaml.safe_load(PROD.read_text())["applications"][0]["args"])


def worker_groups() -> dict[str, dict]:
    return {g["groupName"]: g for g in rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def gpus_per_pod(group: dict) -> int:
    [container] = group["template"]["spec"]["containers"]
    return int(container["resources"]["limits"].get("nvidia.com/gpu", 0))


def cpus_per_pod(group: dict) -> float:
    [container] = group["template"]["spec"]["containers"]
    return float(container["resources"]["requests"]["cpu"])


def test_embedded_serve_config_is_prod_yaml_verbatim():
    assert embedded_text() == PROD.read_text(), REFRESH
    assert yaml.safe_load(embedded_text()) == yaml.safe_load(PROD.read_text()), REFRESH


def test_embed_script_reports_no_drift():
    spec = importlib.util.spec_from_file_location("embed", REPO / "cluster" / "kuberay" / "embed_serve_config.py")
    embed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(embed)
    assert embed.main(["--check"]) == 0, REFRESH
    # and the refresh really rewrites a drifted block
    drifted = RAYSERVICE.read_text().replace("max_num_seqs: 64", "max_num_seqs: 65", 1)
    assert embed.refreshed_manifest(drifted, PROD.read_text()) == RAYSERVICE.read_text()


def test_embedded_serve_config_validates_against_app_schema():
    applications = yaml.safe_load(embedded_text())["applications"]
    assert applications[0]["import_path"] == "app.main:build_app"
    app = load_app_config(applications[0]["args"])
    assert app.device == "gpu"


def test_rayservice_shape():
    service = rayservice()
    assert service["apiVersion"] == "ray.io/v1"
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["rayVersion"] == "2.60.0"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["rayStartParams"]["metrics-export-port"] == "8080"
    [head_container] = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"]
    assert {"name": "metrics", "containerPort": 8080} in head_container["ports"]
    assert {"name": "dashboard", "containerPort": 8265} in head_container["ports"]
    for group in worker_groups().values():
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        [container] = group["template"]["spec"]["containers"]
        assert {"name": "metrics", "containerPort": 8080} in container["ports"]


def test_gcs_fault_tolerance_uses_external_redis_secret():
    options = rayservice()["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert options["redisAddress"] == "redis:6379"
    ref = options["redisPassword"]["valueFrom"]["secretKeyRef"]
    redis_docs = list(yaml.safe_load_all((REPO / "cluster" / "kuberay" / "redis.yaml").read_text()))
    [deployment] = [d for d in redis_docs if d["kind"] == "Deployment"]
    [env] = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env["valueFrom"]["secretKeyRef"] == ref  # Redis and the head read the one Secret the README creates
    services = {d["metadata"]["name"]: d for d in redis_docs if d["kind"] == "Service"}
    host, port = options["redisAddress"].split(":")
    assert services[host]["spec"]["ports"][0]["port"] == int(port)


def all_pod_specs() -> dict[str, dict]:
    cluster = rayservice()["spec"]["rayClusterConfig"]
    pods = {"head": cluster["headGroupSpec"]["template"]}
    pods.update({name: g["template"] for name, g in worker_groups().items()})
    return pods


def test_every_ray_pod_gets_the_batch_store_connection():
    for name, template in all_pod_specs().items():
        [container] = template["spec"]["containers"]
        assert {"secretRef": {"name": "llm-lanes-batch-store"}} in [
            {"secretRef": {"name": e["secretRef"]["name"]}} for e in container.get("envFrom", [])], name
    postgres = [d for d in yaml.safe_load_all((REPO / "cluster" / "kuberay" / "postgres.yaml").read_text()) if d]
    [statefulset] = [d for d in postgres if d["kind"] == "StatefulSet"]
    [postgres_container] = statefulset["spec"]["template"]["spec"]["containers"]
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in postgres_container["env"] if "valueFrom" in e}
    assert refs == {"llm-lanes-batch-store"}  # the in-cluster option reads the same Secret


def test_grpc_is_reachable_through_its_own_service():
    docs = [d for d in yaml.safe_load_all(RAYSERVICE.read_text()) if d]
    [grpc] = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "llm-lanes-grpc"]
    [port] = grpc["spec"]["ports"]
    grpc_port = yaml.safe_load(PROD.read_text())["grpc_options"]["port"]
    assert port["port"] == grpc_port
    selector = grpc["spec"]["selector"]
    assert selector["ray.io/serve"] == "true"  # the label KubeRay sets on pods whose Serve proxy is healthy
    for name, template in all_pod_specs().items():
        labels = template["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in selector.items() if k != "ray.io/serve"), name
        [container] = template["spec"]["containers"]
        assert {"name": port["targetPort"], "containerPort": grpc_port} in container["ports"], name


def test_gpu_pods_select_one_gpu_model_and_tolerate_gpu_taints():
    for name, group in worker_groups().items():
        spec = group["template"]["spec"]
        assert spec["nodeSelector"].get("nvidia.com/gpu.product"), name
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"], name


def test_images_agree_on_ray_and_cuda_and_the_vm_driver_fits():
    dockerfile = (REPO / "cluster" / "kuberay" / "Dockerfile").read_text()
    [base] = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("FROM ")]
    vm_image = vm_cluster()["docker"]["image"]
    assert base == vm_image == "rayproject/ray-llm:2.60.0-py312-cu130"
    ray_version = base.split(":")[1].split("-")[0]
    assert rayservice()["spec"]["rayClusterConfig"]["rayVersion"] == ray_version
    assert f'"ray[serve]=={ray_version}"' in (REPO / "pyproject.toml").read_text()
    for template in all_pod_specs().values():
        assert template["spec"]["containers"][0]["image"].endswith(f"-ray{ray_version}-cu130")
    # CUDA 13.0 needs driver 580 or newer: every boot image family names its driver branch
    families = re.findall(r"family/(\S+)", VM_CLUSTER.read_text())
    assert families and all(int(re.search(r"nvidia-(\d+)", f).group(1)) >= 580 for f in families), families


def test_hot_lane_pairs_fit_the_hot_group():
    app = prod_app()
    tp = app.hot_lane.engine.tensor_parallel_size
    group = worker_groups()["hot-tp-pairs"]
    # STRICT_PACK: a replica's TP GPUs must all be on one pod
    assert gpus_per_pod(group) >= tp, f"hot group pods have {gpus_per_pod(group)} GPUs, a hot replica needs {tp}"
    replicas_per_pod = gpus_per_pod(group) // tp
    needed_pods = math.ceil(app.hot_lane.deployment.num_replicas / replicas_per_pod)
    assert group["maxReplicas"] >= needed_pods
    assert group["minReplicas"] >= needed_pods  # the hot lane is fixed-size: its pods are always there


def test_cold_lane_replicas_fit_the_cold_group():
    app = prod_app()
    tp = app.cold_lane.engine.tensor_parallel_size
    scaling = app.cold_lane.deployment.autoscaling
    assert scaling is not None
    group = worker_groups()["cold-tp-pairs"]
    assert gpus_per_pod(group) >= tp
    replicas_per_pod = gpus_per_pod(group) // tp
    assert group["minReplicas"] * replicas_per_pod >= scaling.min_replicas
    assert group["maxReplicas"] * replicas_per_pod >= scaling.max_replicas, "the autoscaler could not reach max"
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_total_gpus_match_the_app_minimum():
    app = prod_app()
    groups = worker_groups()
    gpus_at_min = sum(g["minReplicas"] * gpus_per_pod(g) for g in groups.values())
    assert gpus_at_min == app.total_gpus  # 2 hot x 2 + 1 cold x 2 = 6


def test_cpus_at_minimum_host_every_cpu_replica():
    """Router, PrefixCache and the lane replicas' CPUs fit the worker pods (the head offers no CPUs)."""
    app = prod_app()
    cluster = rayservice()["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    needed = (
        app.router.num_replicas * app.router.num_cpus
        + app.prefix_cache.num_cpus
        + app.hot_lane.deployment.num_replicas * app.hot_lane.deployment.num_cpus
        + app.cold_lane.deployment.autoscaling.min_replicas * app.cold_lane.deployment.num_cpus
    )
    offered = sum(g["minReplicas"] * cpus_per_pod(g) for g in worker_groups().values())
    assert offered >= needed


# ---- Ray cluster launcher YAML ------------------------------------------------------------------------------------


def vm_cluster() -> dict:
    return yaml.safe_load(VM_CLUSTER.read_text())


def test_vm_cluster_node_types_host_the_lanes():
    app = prod_app()
    cfg = vm_cluster()
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    hot, cold = types["hot_tp_pair"], types["cold_tp_pair"]
    hot_tp = app.hot_lane.engine.tensor_parallel_size
    cold_tp = app.cold_lane.engine.tensor_parallel_size
    assert hot["resources"]["GPU"] >= hot_tp
    assert hot["min_workers"] * (hot["resources"]["GPU"] // hot_tp) >= app.hot_lane.deployment.num_replicas
    scaling = app.cold_lane.deployment.autoscaling
    assert cold["resources"]["GPU"] >= cold_tp
    assert cold["min_workers"] * (cold["resources"]["GPU"] // cold_tp) >= scaling.min_replicas
    assert cold["max_workers"] * (cold["resources"]["GPU"] // cold_tp) >= scaling.max_replicas
    assert cfg["max_workers"] >= sum(t.get("max_workers", 0) for t in types.values())
    assert any("pip install" in command and "llm-lanes" in command for command in cfg["setup_commands"])

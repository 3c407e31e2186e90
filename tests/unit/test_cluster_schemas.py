"""cluster/ against the real schemas: the RayService against KubeRay's ray.io/v1 spec (unknown fields are errors), the
other Kubernetes objects against the Kubernetes API models, the launcher YAML against Ray's own ray-schema.json and
its prepare_config / validate_config, prod.yaml against Ray Serve's ServeDeploySchema, and the Grafana dashboard's
PromQL through a PromQL parser."""

from __future__ import annotations

import copy
import json
import re
import typing
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")
k8s = pytest.importorskip("kubernetes.client")

REPO = Path(__file__).resolve().parents[2]
KUBERAY = REPO / "cluster" / "kuberay"
RAYSERVICE_SCHEMA = REPO / "tests" / "schemas" / "kuberay-v1.3-rayservice.yaml"

# ---- Kubernetes types, from the kubernetes client's OpenAPI models -------------------------------------------------

SCALARS = {"str": {"type": "string"}, "int": {"type": "integer"}, "bool": {"type": "boolean"},
           "float": {"type": "number"}, "datetime": {"type": "string"}, "date": {"type": "string"},
           "object": {}}  # "object": int-or-string and free-form fields
# resource quantities are int-or-string in the API ("16", 16, "160Gi")
QUANTITY = {"type": ["string", "integer", "number"]}


def _type_schema(type_name: str, defs: dict[str, Any]) -> dict[str, Any]:
    if type_name in SCALARS:
        return dict(SCALARS[type_name])
    if match := re.fullmatch(r"List\[(.+)\]", type_name):
        return {"type": "array", "items": _type_schema(match.group(1), defs)}
    if match := re.fullmatch(r"Dict\[str, (.+)\]", type_name):
        return {"type": "object", "additionalProperties": _type_schema(match.group(1), defs)}
    _model_def(type_name, defs)
    return {"$ref": f"#/$defs/{type_name}"}


def _model_def(name: str, defs: dict[str, Any]) -> None:
    if name in defs:
        return
    model = getattr(k8s, name)
    defs[name] = {}  # placeholder: recursive types refer to it while it is built
    properties = {}
    for attribute, type_name in model.openapi_types.items():
        properties[model.attribute_map[attribute]] = _type_schema(type_name, defs)
    if name == "V1ResourceRequirements":
        properties["limits"] = properties["requests"] = {"type": "object", "additionalProperties": QUANTITY}
    defs[name] = {"type": "object", "properties": properties}


def k8s_schema(model: str) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    _model_def(model, defs)
    return strict({"$ref": f"#/$defs/{model}", "$defs": defs})


def strict(schema: Any) -> Any:
    """additionalProperties: false wherever properties are listed (as the API server prunes or, with field validation,
    rejects unknown fields), except where a schema preserves unknown fields."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


@cache
def rayservice_schema() -> dict[str, Any]:
    schema = yaml.safe_load(RAYSERVICE_SCHEMA.read_text())
    defs: dict[str, Any] = {}

    def expand(node: Any) -> Any:
        if isinstance(node, dict):
            if "x-k8s-model" in node:
                _model_def(node["x-k8s-model"], defs)
                return {"$ref": f"#/$defs/{node['x-k8s-model']}"}
            return {key: expand(value) for key, value in node.items()}
        if isinstance(node, list):
            return [expand(item) for item in node]
        return node

    expanded = expand(schema)
    expanded["$defs"] = defs
    return strict(expanded)


def errors(document: dict, schema: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(document)]


def manifests(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((KUBERAY / name).read_text()) if d]


def rayservice() -> dict:
    [service] = [d for d in manifests("rayservice.yaml") if d["kind"] == "RayService"]
    return service


def test_rayservice_matches_kuberays_spec():
    assert errors(rayservice(), rayservice_schema()) == []


@pytest.mark.parametrize("path, value, complaint", [
    (["spec", "rayClusterConfig", "gcsFaultTolerance"], {}, "Additional properties"),  # misspelt field
    (["spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0, "envForm"], [],
     "Additional properties"),  # a typo inside the pod template
    (["spec", "rayClusterConfig", "workerGroupSpecs", 0, "minReplicas"], "2", "is not of type 'integer'"),
    (["spec", "rayClusterConfig", "headGroupSpec", "rayStartParams", "num-gpus"], 0, "is not of type 'string'"),
    (["spec", "rayClusterConfig", "autoscalerOptions", "upscalingMode"], "Fast", "is not one of"),
])
def test_the_rayservice_check_catches_unknown_fields_and_wrong_types(path, value, complaint):
    broken = copy.deepcopy(rayservice())
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    found = errors(broken, rayservice_schema())
    assert any(complaint in e for e in found), found


KIND_MODELS = {"Service": "V1Service", "Deployment": "V1Deployment", "StatefulSet": "V1StatefulSet",
               "Secret": "V1Secret"}


@pytest.mark.parametrize("name", ["rayservice.yaml", "redis.yaml", "postgres.yaml"])
def test_kubernetes_objects_match_the_api_models(name):
    for document in manifests(name):
        if document["kind"] == "RayService":
            continue
        model = KIND_MODELS[document["kind"]]
        assert errors(document, k8s_schema(model)) == [], (name, document["metadata"]["name"])


def test_secrets_are_created_once_by_the_readme_not_by_manifests():
    """Applying a file that carries a Secret would overwrite the one the README's step created."""
    for name in ("rayservice.yaml", "redis.yaml", "postgres.yaml"):
        assert not [d for d in manifests(name) if d["kind"] == "Secret"], name
    readme = (REPO / "cluster" / "README.md").read_text()
    options = rayservice()["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    ref = options["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert f"kubectl create secret generic {ref['name']} --from-literal={ref['key']}=" in readme
    assert "kubectl create secret generic llm-lanes-batch-store" in readme


# ---- the Ray cluster launcher ---------------------------------------------------------------------------------------


def vm_cluster() -> dict:
    return yaml.safe_load((REPO / "cluster" / "vm" / "ray-cluster.yaml").read_text())


def test_vm_cluster_matches_rays_schema_and_passes_prepare_and_validate_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema_path = Path(__import__("ray").__file__).parent / "autoscaler" / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    assert errors(vm_cluster(), schema) == []
    validate_config(prepare_config(vm_cluster()))  # raises on an invalid config


def test_the_launcher_check_catches_an_unknown_field():
    from ray.autoscaler._private.util import prepare_config, validate_config

    broken = vm_cluster()
    broken["available_node_types"]["hot_tp_pair"]["min_worker"] = 2  # misspelt min_workers
    with pytest.raises(Exception):
        validate_config(prepare_config(broken))


# ---- Ray Serve ------------------------------------------------------------------------------------------------------


def _models_in(annotation: Any) -> list[type]:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models_in(arg)]


def unknown_serve_keys(model: type, raw: Any, where: str = "") -> list[str]:
    """Keys ServeDeploySchema does not define. Serve's schema accepts and drops them, so a misspelt option (say
    http_options.request_timeout) would be ignored without a word."""
    if not isinstance(raw, dict):
        return []
    fields = {(info.alias or name): info for name, info in model.model_fields.items()}
    found = []
    for key, value in raw.items():
        if key not in fields:
            found.append(f"{where}{key}")
            continue
        for sub in _models_in(fields[key].annotation):
            for index, item in enumerate(value if isinstance(value, list) else [value]):
                suffix = f"[{index}]" if isinstance(value, list) else ""
                found += unknown_serve_keys(sub, item, f"{where}{key}{suffix}.")
    return found


def prod_serve_config() -> dict:
    return yaml.safe_load((REPO / "serve_configs" / "prod.yaml").read_text())


def test_prod_yaml_matches_serve_deploy_schema():
    from ray.serve.schema import ServeDeploySchema

    raw = prod_serve_config()
    config = ServeDeploySchema.model_validate(raw)
    assert config.http_options.request_timeout_s == 900
    assert [a.import_path for a in config.applications] == ["app.main:build_app"]
    assert unknown_serve_keys(ServeDeploySchema, raw) == []


def test_the_serve_check_catches_a_misspelt_option():
    from ray.serve.schema import ServeDeploySchema

    raw = prod_serve_config()
    raw["http_options"]["request_timeout"] = 900
    raw["applications"][0]["import_pth"] = "app.main:build_app"
    assert unknown_serve_keys(ServeDeploySchema, raw) == ["http_options.request_timeout",
                                                          "applications[0].import_pth"]


# ---- Grafana dashboard ----------------------------------------------------------------------------------------------

# Grafana replaces these before the query reaches Prometheus: $__rate_interval by a duration, $application by the
# variable's value.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$application": "llm-lanes"}


def dashboard_queries() -> list[str]:
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads((REPO / "cluster" / "grafana" / "llm-lanes-dashboard.json").read_text()))
    return found


def as_prometheus_sees_it(query: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    assert "$" not in query, f"a Grafana variable this test does not know: {query}"
    return query


def test_dashboard_promql_parses():
    promql_parser = pytest.importorskip("promql_parser")
    queries = dashboard_queries()
    assert len(queries) >= 20
    for query in queries:
        promql_parser.parse(as_prometheus_sees_it(query))  # raises ValueError with the parser's message


def test_the_promql_check_catches_a_broken_query():
    promql_parser = pytest.importorskip("promql_parser")
    with pytest.raises(ValueError):
        promql_parser.parse(as_prometheus_sees_it(
            "sum by (lane) (rate(ray_llm_lanes_requests_total[$__rate_interval])"))  # one ")" short

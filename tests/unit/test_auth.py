"""API keys: hashing, the key sources, the 401/403 answers, and the surfaces that ask for them (fake lanes)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from fastapi.testclient import TestClient

from app.classes import RequestClass
from app.config import AuthConfig, ConfigError, load_app_config
from app.router import openai_api as api
from app.router.auth import (
    OPEN_PRINCIPAL, KeyRing, KeySourceError, bearer_token, check_class, hash_key, load_keys, require_admin,
)
from app.router.body_limit import BodyLimits, set_limits
from app.router.http_api import HTTP_ROUTES, make_http_app
from tests.fakes import cpu_args, make_router

ALICE, BOB, ADMIN = "sk-alice-0123456789", "sk-bob-0123456789", "sk-admin-0123456789"
KEYS = [{"sha256": hash_key(ALICE), "tenant": "team-a", "name": "alice", "classes": ["interactive", "batch"]},
        {"sha256": hash_key(BOB), "tenant": "team-b"},
        {"sha256": hash_key(ADMIN), "tenant": "ops", "admin": True}]


def ring(**auth) -> KeyRing:
    return KeyRing.from_config(AuthConfig.model_validate({"keys": KEYS, **auth}))


def test_a_key_is_found_by_its_hash_and_names_its_tenant_and_classes():
    keys = ring()
    alice = keys.authenticate(f"Bearer {ALICE}")
    assert (alice.tenant, alice.label, alice.admin) == ("team-a", "alice", False)
    assert alice.classes == {RequestClass.INTERACTIVE, RequestClass.BATCH}
    bob = keys.authenticate(f"bearer  {BOB} ")
    assert bob.tenant == "team-b" and bob.label == hash_key(BOB)[:8] and bob.classes == set(RequestClass)
    assert keys.tenants == {"team-a", "team-b", "ops"}


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer sk-bogus", f"Basic {ALICE}", ALICE])
def test_no_key_or_a_wrong_one_is_401_invalid_api_key_without_the_key_in_it(header):
    with pytest.raises(api.OpenAIError) as caught:
        ring().authenticate(header)
    error = caught.value
    assert (error.status, error.code, error.headers) == (401, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
    assert "sk-" not in error.message


def test_grpc_metadata_carries_the_key_case_insensitively():
    keys = ring()
    assert keys.authenticate_metadata([("x-other", "1"), ("authorization", f"Bearer {BOB}")]).tenant == "team-b"
    assert keys.authenticate_metadata([("Authorization", f"Bearer {ADMIN}".encode())]).admin
    with pytest.raises(api.OpenAIError):
        keys.authenticate_metadata([])


def test_mode_none_is_one_open_tenant_and_keys_mode_without_keys_refuses_to_start():
    assert KeyRing.from_config(AuthConfig(mode="none")).authenticate(None) is OPEN_PRINCIPAL
    with pytest.raises(KeySourceError, match="mode: none explicitly"):
        KeyRing.from_config(AuthConfig())
    with pytest.raises(ConfigError, match="auth: .*mode 'none' would ignore"):
        load_app_config(cpu_args(auth={"mode": "none", "keys": KEYS}))


def test_the_schema_takes_hashes_only():
    with pytest.raises(ConfigError, match=r"auth.keys.0: sha256 must be 64 lower-case hex digits"):
        load_app_config(cpu_args(auth={"keys": [{"sha256": ALICE, "tenant": "a"}]}))
    with pytest.raises(ConfigError, match="listed twice"):
        load_app_config(cpu_args(auth={"keys": [KEYS[0], KEYS[0]]}))


def test_keys_come_from_a_file_and_an_environment_variable_too(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(json.dumps([KEYS[1]]))
    auth = AuthConfig(keys=[KEYS[0]], keys_file=str(path), keys_env="TEST_KEYS")
    keys = load_keys(auth, {"TEST_KEYS": json.dumps([KEYS[2]])})
    assert [k.tenant for k in keys] == ["team-a", "team-b", "ops"]
    with pytest.raises(KeySourceError, match="TEST_KEYS, which is not set"):
        load_keys(auth, {})
    path.write_text(json.dumps([{"sha256": "nothex", "tenant": "x"}]))
    with pytest.raises(KeySourceError, match="keys_file"):
        load_keys(auth, {"TEST_KEYS": "[]"})
    with pytest.raises(KeySourceError, match="does not exist"):
        load_keys(AuthConfig(keys_file=str(tmp_path / "missing")), {})
    with pytest.raises(KeySourceError, match="listed twice"):
        KeyRing(AuthConfig(), load_keys(AuthConfig(keys=[KEYS[0]], keys_env="K"), {"K": json.dumps([KEYS[0]])}))


def test_bearer_token_parsing():
    assert bearer_token("Bearer abc") == "abc" and bearer_token("BEARER abc") == "abc"
    assert bearer_token("Token abc") is None and bearer_token(None) is None


def test_a_class_the_key_may_not_use_is_403_and_admin_needs_the_flag():
    alice = ring().authenticate(f"Bearer {ALICE}")
    check_class(alice, RequestClass.BATCH)
    with pytest.raises(api.OpenAIError) as caught:
        check_class(alice, RequestClass.REALTIME)
    assert (caught.value.status, caught.value.code, caught.value.param) == (403, "request_class_not_allowed",
                                                                           "service_tier")
    with pytest.raises(api.OpenAIError) as caught:
        require_admin(alice)
    assert (caught.value.status, caught.value.code) == (403, "admin_key_required")
    require_admin(ring().authenticate(f"Bearer {ADMIN}"))


# ---- the surfaces ---------------------------------------------------------------------------------------------------

@pytest.fixture
def surfaces(tmp_path):
    router = make_router(tmp_path, auth={"keys": KEYS})
    app = make_http_app()
    set_limits(BodyLimits(request_bytes=4096, upload_bytes=1 << 20))
    for name in ("completions", "models", "admin_prefix_lookup"):
        HTTP_ROUTES[name](app)(getattr(router, name))
    try:
        with TestClient(app) as client:
            yield client, router
    finally:
        set_limits(None)


def completion(**extra):
    return {"model": "tiny", "prompt": "hello", "max_tokens": 4, **extra}


def test_http_generation_needs_a_key_and_a_class_it_may_use(surfaces):
    client, router = surfaces
    assert client.post("/v1/completions", json=completion()).status_code == 401
    wrong = client.post("/v1/completions", json=completion(), headers={"Authorization": "Bearer sk-bogus"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    ok = client.post("/v1/completions", json=completion(), headers={"Authorization": f"Bearer {ALICE}"})
    assert ok.status_code == 200, ok.text
    refused = client.post("/v1/completions", json=completion(service_tier="priority"),
                          headers={"Authorization": f"Bearer {ALICE}"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "request_class_not_allowed"
    assert len(router.lanes["hot"].requests) == 1  # only the allowed request reached a lane
    assert client.get("/v1/models").status_code == 401
    models = client.get("/v1/models", headers={"Authorization": f"Bearer {BOB}"})
    assert models.status_code == 200
    # The card says when this replica began serving the model, as a Unix time (not 0: clients sort and show it).
    card = models.json()["data"][0]
    assert card["created"] == router.pipeline.serving_since and abs(card["created"] - time.time()) < 600


def test_admin_endpoints_need_an_admin_key(surfaces):
    client, _ = surfaces
    assert client.post("/v1/admin/prefix_lookup", json={"prompt": "x"}).status_code == 401
    forbidden = client.post("/v1/admin/prefix_lookup", json={"prompt": "x"},
                            headers={"Authorization": f"Bearer {BOB}"})
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "admin_key_required"


def test_http_bodies_over_the_limit_are_413_before_parsing(surfaces):
    client, router = surfaces
    big = completion(prompt="x" * 5000)
    response = client.post("/v1/completions", json=big, headers={"Authorization": f"Bearer {ALICE}"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunks():
        yield json.dumps(big).encode()

    chunked = client.post("/v1/completions", content=chunks(), headers={"Authorization": f"Bearer {ALICE}",
                                                                        "content-type": "application/json"})
    assert chunked.status_code == 413
    assert not router.lanes["hot"].requests


class FakeGrpcContext:
    def __init__(self, metadata=()):
        self.metadata = list(metadata)
        self.code = None

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def set_trailing_metadata(self, metadata):
        self.trailing = metadata


def test_grpc_needs_a_key_admin_rpcs_an_admin_key_and_big_messages_are_refused(tmp_path):
    from app.proto.llm_lanes.v1 import llm_lanes_pb2 as pb

    router = make_router(tmp_path, auth={"keys": KEYS}, router={"max_request_bytes": 2048})
    request = pb.CompletionRequest(model="tiny", prompt="hello")

    async def complete(metadata):
        context = FakeGrpcContext(metadata)
        response = await router.Complete(request, context)
        return context.code, response

    assert asyncio.run(complete([]))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(complete([("authorization", "Bearer sk-bogus")]))[0] == grpc.StatusCode.UNAUTHENTICATED
    code, response = asyncio.run(complete([("authorization", f"Bearer {BOB}")]))
    assert code is None and response.text == "abcdef"
    context = FakeGrpcContext([("authorization", f"Bearer {BOB}")])
    asyncio.run(router.GetStats(pb.GetStatsRequest(), context))
    assert context.code == grpc.StatusCode.PERMISSION_DENIED
    context = FakeGrpcContext([("authorization", f"Bearer {BOB}")])
    asyncio.run(router.Complete(pb.CompletionRequest(model="tiny", prompt="x" * 4096), context))
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_grpc_an_empty_model_is_not_found_as_on_http(tmp_path):
    from app.proto.llm_lanes.v1 import llm_lanes_pb2 as pb

    router = make_router(tmp_path)
    context = FakeGrpcContext()
    asyncio.run(router.Complete(pb.CompletionRequest(prompt="hello"), context))
    assert context.code == grpc.StatusCode.NOT_FOUND and "model" in context.details


def test_grpc_an_openai_field_vllm_does_not_know_is_invalid_argument_naming_it(tmp_path):
    from google.protobuf import struct_pb2

    from app.proto.llm_lanes.v1 import llm_lanes_pb2 as pb

    fields = struct_pb2.Struct()
    fields.update({"temprature": 0})
    router = make_router(tmp_path)
    context = FakeGrpcContext()
    asyncio.run(router.Complete(pb.CompletionRequest(model="tiny", prompt="hello", openai_fields=fields), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "temprature" in context.details


def test_tenant_weights_name_tenants_of_keys_with_weights_of_1_to_100():
    assert ring(tenant_weights={"team-a": 3}).tenants == {"team-a", "team-b", "ops"}
    with pytest.raises(KeySourceError, match=r"auth.tenant_weights names 'team-z', the tenant of no key"):
        ring(tenant_weights={"team-z": 2})
    with pytest.raises(ConfigError, match=r"auth: .*tenant_weights: 'team-a' has weight 0; a weight is 1 to 100"):
        load_app_config(cpu_args(auth={"keys": KEYS, "tenant_weights": {"team-a": 0}}))
    with pytest.raises(ConfigError, match=r"auth: .*tenant_weights needs keys"):
        load_app_config(cpu_args(auth={"mode": "none", "tenant_weights": {"default": 2}}))

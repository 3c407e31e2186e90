"""The run-time LoRA endpoints' pure parts: what is refused before any file is read, the bodies' shapes, and which
adapters a key and a tenant's batch lines may use."""

from __future__ import annotations

import pytest

from app.config import load_app_config
from app.config.security import AuthConfig
from app.router import openai_api as api
from app.router.adapter_api import LoadAdapterBody, UnloadAdapterBody, _parse, load_refusal
from app.router.auth import KeyRing
from tests.fakes import cpu_args


def lora_cfg(adapters=()):
    args = cpu_args()
    args["model"]["adapters"] = [{"name": name, "path": "/adapters/" + name} for name in adapters]
    for lane in ("hot_lane", "cold_lane"):
        args[lane]["engine"]["lora"] = {"max_loras": 2, "max_lora_rank": 8}
    return load_app_config(args)


@pytest.mark.parametrize("name, param, message", [
    ("tiny", "lora_name", "conflicts with a served base model"),
    ("llm-lanes-identity", "lora_name", "identity adapter"),
    ("static-a", "lora_name", "listed in model.adapters"),
    ("bad name", "lora_name", "is not an adapter name"),
])
def test_a_load_that_could_never_be_served_is_refused_naming_the_field(name, param, message):
    refusal = load_refusal(name, "/some/folder", lora_cfg(["static-a"]))
    assert refusal is not None and refusal[1] == param and message in refusal[0]


def test_a_load_is_refused_where_the_lanes_run_no_lora_and_allowed_otherwise():
    no_lora = load_app_config(cpu_args())
    assert "set engine.lora on every lane" in load_refusal("sql", "/f", no_lora)[0]
    assert load_refusal("sql", "/f", lora_cfg()) is None
    assert load_refusal("sql", "", lora_cfg())[1] == "lora_path"


@pytest.mark.parametrize("model, body, param, code", [
    (LoadAdapterBody, {"lora_name": "a", "lora_path": "/p", "is_3d_lora_weight": True}, "is_3d_lora_weight",
     "unrecognized_argument"),
    (LoadAdapterBody, {"lora_name": "a"}, "lora_path", "invalid_value"),
    (UnloadAdapterBody, {"lora_name": "a", "lora_int_id": "x"}, "lora_int_id", "invalid_value"),
])
def test_a_malformed_body_is_400_naming_the_parameter(model, body, param, code):
    with pytest.raises(api.OpenAIError) as refused:
        _parse(model, body)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, param, code)


def key(sha_digit: str, tenant: str, adapters=None) -> dict:
    return {"sha256": sha_digit * 64, "tenant": tenant, "adapters": adapters}


def test_a_tenants_batch_lines_may_use_the_adapters_of_its_keys_together():
    ring = KeyRing(AuthConfig(mode="keys"), [
        AuthConfig.model_validate({"keys": [key("a", "acme", ["sql"]), key("b", "acme", ["chat"]),
                                            key("c", "open-co"), key("d", "solo", [])]}).keys[i] for i in range(4)])
    assert ring.tenant_adapters("acme") == frozenset({"sql", "chat"})
    assert ring.tenant_adapters("open-co") is None  # one key of the tenant may use every adapter
    assert ring.tenant_adapters("solo") == frozenset()
    principal = ring.authenticate(None) if ring.open else None
    assert principal is None
    assert KeyRing(AuthConfig(mode="none")).tenant_adapters("default") is None


class _Surface:
    async def model_cards(self):
        return [{"id": "tiny", "parent": None}, {"id": "sql", "parent": "tiny", "root": "/a/sql"},
                {"id": "chat", "parent": "tiny", "root": "/a/chat"}]


class _Pipeline:
    def __init__(self):
        self.cfg = lora_cfg()
        self.model = self.cfg.model.served_name
        self.surface = _Surface()
        self.serving_since = 0


async def test_a_key_limited_to_adapters_lists_only_the_base_model_and_its_own():
    import dataclasses

    from app.router.auth import OPEN_PRINCIPAL
    from app.router.http_api import HttpApi

    surface = HttpApi()
    surface.pipeline = _Pipeline()
    limited = dataclasses.replace(OPEN_PRINCIPAL, adapters=frozenset({"sql"}))
    assert [card["id"] for card in await surface._model_cards(limited)] == ["tiny", "sql"]
    assert [card["id"] for card in await surface._model_cards(OPEN_PRINCIPAL)] == ["tiny", "sql", "chat"]

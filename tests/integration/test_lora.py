"""LoRA adapters on the real CPU engines: listed as vLLM's server lists them, answered as vLLM's own server answers
with the same adapters (chat and completions, streamed and not), carried through the decode handoff, and routed to
the hot replica that holds them. The app is test_decode_handoff.py's (two hot replicas, so the lanes' own request
router chooses between them; model.adapters "tiny-lora-a" and "tiny-lora-b", engine.lora on both lanes)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from load_tests.openai_differential import compare_adapter_answers
from tests.integration.conftest import lane_stats, router_stats, wait_until
from tests.integration.test_decode_handoff import ADAPTER_SEEDS, APP, HOT_REPLICAS, _write_config
from tests.integration.test_openai_differential import vllm_own_server
from tests.integration.test_prefix_affinity_and_scaling import hot_replicas_report, lanes

pytestmark = pytest.mark.app(APP)
ADAPTERS = list(ADAPTER_SEEDS)


@pytest.fixture(scope="module")
def lora_app(apps):
    return apps.use(APP, _write_config, ready=hot_replicas_report(HOT_REPLICAS))


@pytest.fixture(scope="module")
def vllm_lora_server(lora_app, tmp_path_factory):
    """vLLM's own OpenAI server with the app's hot-lane engine arguments (LoRA on) and `--lora-modules` of the same
    adapters (started after the app: they share the cores)."""
    document = yaml.safe_load(lora_app.config.read_text())
    yield from vllm_own_server(document, Path(tmp_path_factory.mktemp("vllm_lora")) / "vllm.log")


def test_models_lists_each_adapter_under_the_base_model(lora_app, served_model):
    cards = httpx.get(f"{lora_app.url}/v1/models", timeout=30).json()["data"]
    assert [card["id"] for card in cards] == [served_model, *ADAPTERS]
    for card in cards[1:]:
        assert card["parent"] == served_model and Path(card["root"]).name == card["id"]
    one = httpx.get(f"{lora_app.url}/v1/models/{ADAPTERS[0]}", timeout=30)
    assert one.status_code == 200 and one.json()["parent"] == served_model


def test_a_model_name_neither_base_nor_adapter_is_404(lora_app):
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})):
        response = httpx.post(f"{lora_app.url}{path}", json={**body, "model": "tiny-lora-missing"}, timeout=60)
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{lora_app.url}/v1/models/tiny-lora-missing", timeout=30).status_code == 404


def test_each_adapter_answers_as_vllms_own_server_with_the_same_adapters(lora_app, vllm_lora_server):
    compared, problems = compare_adapter_answers(lora_app.url, vllm_lora_server, ADAPTERS)
    assert not problems, "\n".join(problems)
    assert compared == len(ADAPTERS) * 8


def test_an_adapters_requests_go_to_the_hot_replica_holding_it(lora_app):
    """Realtime requests for an adapter (they go to the hot replica kept for realtime, realtime_reserve.py): once
    that replica's routing stats say it holds the adapter, the lanes' request router routes the next ones there
    because it does ("adapter_loaded" in its decision stats), and the replica that answers holds it."""
    url = lora_app.url
    body = {"model": ADAPTERS[1], "prompt": "The json module encodes", "max_tokens": 4, "temperature": 0}
    answered_by: list[str] = []

    def routed_to_a_holder() -> bool:
        response = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Class": "realtime"},
                              timeout=60)
        assert response.status_code == 200, response.text
        answered_by.append(response.headers["x-llm-lanes-replica"])
        routing = router_stats(url)["replica_routing"].get("HotLane", {})
        return routing.get("adapter_routing", {}).get("adapter_loaded", 0) >= 1

    assert wait_until(routed_to_a_holder, timeout_s=60, interval_s=0.5), \
        f"no request for {ADAPTERS[1]} was routed as held: {router_stats(url)['replica_routing']}"
    held = {replica["replica_id"]: replica.get("adapters_held", []) for replica in lanes(url)["hot"]}
    assert ADAPTERS[1] in held[answered_by[-1]], (answered_by, held)


def test_the_decode_handoff_carries_the_adapter_to_the_cold_lane(lora_app, vllm_lora_server):
    """An interactive chat for an adapter: its first token on the hot lane, the rest on the cold lane under the same
    adapter, the same greedy text as vLLM's own server gives for it."""
    body = {"model": ADAPTERS[0], "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    ours = httpx.post(f"{lora_app.url}/v1/chat/completions", json=body, timeout=120)
    theirs = httpx.post(f"{vllm_lora_server}/v1/chat/completions", json=body, timeout=120)
    assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
    assert ours.headers["x-llm-lanes-degraded"] == "decode_on_cold"
    assert ours.json()["choices"][0]["message"]["content"] == theirs.json()["choices"][0]["message"]["content"]
    assert ADAPTERS[0] in lane_stats(lora_app.url)["cold"].get("adapters_held", [])

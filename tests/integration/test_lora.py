"""LoRA adapters on the real CPU engines: listed as vLLM's server lists them, answered as vLLM's own server answers
with the same adapters (chat and completions, streamed and not), carried through the decode handoff, routed to the
hot replica that holds them, loaded and unloaded at run time under traffic (and through the durable store, as
another Router replica would), and named by batch lines. The app is test_decode_handoff.py's (two hot replicas, so
the lanes' own request router chooses between them; model.adapters "tiny-lora-a" and "tiny-lora-b", engine.lora on
both lanes)."""

from __future__ import annotations

import threading
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


def _complete(url: str, model: str, prompt: str = "The json module encodes") -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})


def test_an_adapter_loaded_at_run_time_is_served_then_unloaded_while_requests_run(lora_app, served_model, tmp_path):
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter under steady requests for the base model and a
    configured adapter: no request fails, each answer is the one its own model gives (no request runs under an
    adapter it did not name), refused loads name why and disturb nothing, the loaded adapter answers as itself."""
    from app.tools.make_tiny_lora import make_tiny_lora

    url = lora_app.url
    tiny_model = Path(yaml.safe_load(lora_app.config.read_text())["applications"][0]["args"]["model"]["source"])
    make_tiny_lora(tiny_model, tmp_path / "tiny-lora-c", seed=5)
    make_tiny_lora(tiny_model, tmp_path / "tiny-lora-wide", seed=6, rank=16)  # above max_lora_rank 8
    expected = {model: _complete(url, model).json()["choices"][0]["text"] for model in (served_model, ADAPTERS[0])}
    assert expected[served_model] != expected[ADAPTERS[0]]
    answers: list[tuple[str, int, str]] = []
    stop = threading.Event()

    def steady_requests(model: str) -> None:
        while not stop.is_set():
            response = _complete(url, model)
            answers.append((model, response.status_code,
                            response.json()["choices"][0]["text"] if response.status_code == 200 else response.text))

    workers = [threading.Thread(target=steady_requests, args=(model,)) for model in expected]
    for worker in workers:
        worker.start()
    try:
        load = httpx.post(f"{url}/v1/load_lora_adapter", timeout=180,
                          json={"lora_name": "tiny-lora-c", "lora_path": str(tmp_path / "tiny-lora-c")})
        assert load.status_code == 200 and "added successfully" in load.text, load.text
        cards = {card["id"]: card for card in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
        assert cards["tiny-lora-c"]["parent"] == served_model
        loaded = _complete(url, "tiny-lora-c")
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["choices"][0]["text"] not in expected.values()
        for body, param in (({"lora_name": "tiny-lora-d", "lora_path": str(tmp_path / "missing")}, "lora_path"),
                            ({"lora_name": "tiny-lora-w", "lora_path": str(tmp_path / "tiny-lora-wide")}, "lora_path"),
                            ({"lora_name": "tiny-lora-c", "lora_path": str(tmp_path / "tiny-lora-c")}, "lora_name"),
                            ({"lora_name": ADAPTERS[1], "lora_path": str(tmp_path / "tiny-lora-c")}, "lora_name")):
            refused = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (body, refused.text)
        unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "tiny-lora-c"}, timeout=60)
        assert unload.status_code == 200 and "removed successfully" in unload.text, unload.text
        assert _complete(url, "tiny-lora-c").status_code == 404
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "tiny-lora-c"},
                          timeout=60).status_code == 404
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": ADAPTERS[0]},
                          timeout=60).status_code == 400
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=180)
    assert len(answers) >= 4, answers
    wrong = [(model, status, text) for model, status, text in answers if status != 200 or text != expected[model]]
    assert not wrong, wrong


def test_a_load_another_router_made_reaches_this_one_through_the_store(lora_app, served_model, tmp_path):
    """The adapters loaded at run time live in the durable store: what another Router replica (here the test, on
    the same store) makes ready is served here within a few seconds, and what it unloads stops being served, as a
    Router started later or restarted reads the set at its start."""
    from app.batch.open_store import open_batch_store
    from app.router.adapter_api import ADAPTER_LOAD_STALE_S, RUNTIME_ADAPTER_FIRST_ID
    from app.tools.make_tiny_lora import make_tiny_lora

    url = lora_app.url
    args = yaml.safe_load(lora_app.config.read_text())["applications"][0]["args"]
    make_tiny_lora(Path(args["model"]["source"]), tmp_path / "tiny-lora-e", seed=7)
    store = open_batch_store(args["batch"]["store"])
    try:
        record = store.reserve_adapter("tiny-lora-e", str(tmp_path / "tiny-lora-e"), False, RUNTIME_ADAPTER_FIRST_ID,
                                       ADAPTER_LOAD_STALE_S)
        store.settle_adapter(record.id, ready=True)

        def listed() -> bool:
            return "tiny-lora-e" in {c["id"] for c in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}

        assert wait_until(listed, timeout_s=10), "the store's adapter never reached the Router"
        answer = _complete(url, "tiny-lora-e")
        assert answer.status_code == 200, answer.text
        store.unload_adapter("tiny-lora-e")
        assert wait_until(lambda: not listed(), timeout_s=10), "the unloaded adapter is still listed"
        assert _complete(url, "tiny-lora-e").status_code == 404
    finally:
        store.close()


def test_batch_lines_run_under_the_adapters_they_name(lora_app, served_model):
    """A batch whose lines name the base model and an adapter: each line's answer is what a direct request for the
    same model answers."""
    import json
    import time

    url = lora_app.url
    models = [served_model, ADAPTERS[0], ADAPTERS[1]]
    lines = [json.dumps({"custom_id": model, "method": "POST", "url": "/v1/completions",
                         "body": {"model": model, "prompt": "The json module encodes", "max_tokens": 6,
                                  "temperature": 0, "ignore_eos": True}}) for model in models]
    uploaded = httpx.post(f"{url}/v1/files", data={"purpose": "batch"}, timeout=60,
                          files={"file": ("lines.jsonl", ("\n".join(lines) + "\n").encode())})
    assert uploaded.status_code == 200, uploaded.text
    batch = httpx.post(f"{url}/v1/batches", timeout=60, json={"input_file_id": uploaded.json()["id"],
                                                              "endpoint": "/v1/completions"}).json()
    deadline = time.monotonic() + 300
    while batch["status"] not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(1)
        batch = httpx.get(f"{url}/v1/batches/{batch['id']}", timeout=30).json()
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == len(models), batch
    output = httpx.get(f"{url}/v1/files/{batch['output_file_id']}/content", timeout=60).text
    answered = {row["custom_id"]: row["response"]["body"] for row in map(json.loads, output.splitlines())}
    for model in models:
        assert answered[model]["model"] == model
        assert answered[model]["choices"][0]["text"] == _complete(url, model).json()["choices"][0]["text"], model

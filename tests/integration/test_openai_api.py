"""The OpenAI-compatible API on the real app: official SDK, streaming, lanes, disconnects, bad input."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.integration.conftest import lane_stats, wait_until

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something about Python."}]


def test_models_lists_the_served_model(openai_client, served_model):
    assert [m.id for m in openai_client.models.list().data] == [served_model]


def test_chat_completion(openai_client, served_model):
    answer = openai_client.chat.completions.create(model=served_model, messages=CHAT, max_tokens=12,
                                                   temperature=0.0, seed=3)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert answer.usage.completion_tokens <= 12 and answer.usage.prompt_tokens > 5
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_greedy_is_deterministic(openai_client, served_model):
    texts = {openai_client.completions.create(model=served_model, prompt="The module", max_tokens=8,
                                              temperature=0).choices[0].text for _ in range(2)}
    assert len(texts) == 1


def test_chat_completion_streaming_with_usage(openai_client, served_model):
    chunks = list(openai_client.chat.completions.create(
        model=served_model, messages=CHAT, max_tokens=10, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_completion_and_streaming_completion(openai_client, served_model):
    answer = openai_client.completions.create(model=served_model, prompt="Return a value", max_tokens=6,
                                              extra_body={"ignore_eos": True})
    assert answer.choices[0].text and answer.usage.completion_tokens == 6
    pieces = [c.choices[0].text for c in openai_client.completions.create(
        model=served_model, prompt="Return a value", max_tokens=6, stream=True, extra_body={"ignore_eos": True})
        if c.choices]
    assert len(pieces) >= 2 and "".join(pieces)


def test_completion_accepts_token_ids(openai_client, served_model):
    answer = openai_client.completions.create(model=served_model, prompt=[5, 6, 7, 8], max_tokens=3)
    assert answer.usage.prompt_tokens == 4


def test_a_misspelt_field_is_refused_naming_it_not_ignored(openai_client, served_model):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model=served_model, messages=CHAT, max_tokens=4,
                                              extra_body={"temprature": 0})
    assert refused.value.body["param"] == "temprature" and refused.value.body["code"] == "unrecognized_argument"
    answer = openai_client.chat.completions.create(model=served_model, messages=CHAT, max_tokens=4, store=False,
                                                   service_tier="flex")
    assert answer.choices[0].message.content


def class_count(replica_stats: dict, counter: str, request_class: str) -> int:
    """One per-class counter (served_by_class, aborted_by_class) of a lane replica's /v1/admin/stats entry."""
    return replica_stats[counter].get(request_class, 0)


@pytest.mark.parametrize("service_tier", [None, "flex", "priority"])
def test_several_prompts_in_one_completion_all_start_at_once(app_url, served_model, service_tier):
    """One lane call per prompt, all waiting for a lane replica together: each gets one (Serve keeps a handle call's
    pending assignment by the id of the client request it belongs to; calls sharing it must not)."""
    prompts = [f"prompt number {i}" for i in range(6)]
    body = {"model": served_model, "prompt": prompts, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            **({"service_tier": service_tier} if service_tier else {})}
    answer = httpx.post(f"{app_url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert sorted(c["index"] for c in answer.json()["choices"]) == list(range(6))
    assert answer.json()["usage"]["completion_tokens"] == 6 * 4
    with httpx.stream("POST", f"{app_url}/v1/completions", json={**body, "stream": True}, timeout=60) as streamed:
        assert streamed.status_code == 200
        finished = {event["choices"][0]["index"] for line in streamed.iter_lines()
                    if line.startswith("data: {") and (event := json.loads(line[6:]))["choices"]
                    and event["choices"][0]["finish_reason"]}
    assert finished == set(range(6))


def test_service_tier_picks_the_lane(app_url, served_model):
    before = lane_stats(app_url)
    served = {}
    for tier, lane in (("flex", "cold"), ("default", "hot"), ("priority", "hot")):
        response = httpx.post(f"{app_url}/v1/completions", timeout=60, json={
            "model": served_model, "prompt": "lanes", "max_tokens": 2, "service_tier": tier})
        assert response.status_code == 200
        assert response.headers["x-llm-lanes-lane"] == lane
        served[tier] = response.headers["x-llm-lanes-request-class"]
    after = lane_stats(app_url)

    def grew(lane, request_class):
        return (class_count(after[lane], "served_by_class", request_class)
                - class_count(before[lane], "served_by_class", request_class))

    assert served == {"flex": "batch", "default": "interactive", "priority": "realtime"}
    assert grew("cold", "batch") == 1 and grew("hot", "batch") == 0
    assert grew("hot", "interactive") == 1 and grew("hot", "realtime") == 1
    assert grew("cold", "interactive") == 0


def test_client_disconnect_aborts_the_engine_request(app_url, served_model):
    # 2,000 output tokens (as long as the context allows), each with its 20 most likely alternatives: several MB of
    # events, more than the sockets between the app and this client buffer, so the app is still sending (and the
    # engine still generating: the tiny model alone decodes 2,000 plain tokens in about two seconds) when the client
    # leaves after the first chunks, however late this process gets a CPU. The lane replica counts the abort, so the
    # test does not have to catch the request running in a stats sample (that read raced the engine and lost).
    body = {"model": served_model, "prompt": "long story", "max_tokens": 2000, "stream": True, "ignore_eos": True,
            "logprobs": 20}
    before = lane_stats(app_url)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{app_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lane = response.headers["x-llm-lanes-lane"]
            assert response.headers["x-llm-lanes-router"]
            lines = response.iter_lines()
            received = [next(lines) for _ in range(2)]
            assert any(line.startswith("data: ") for line in received)
        # Leaving the block closes the connection mid-stream.
    aborted_before = class_count(before[lane], "aborted_by_class", "interactive")

    def settled() -> dict | None:
        stats = lane_stats(app_url)[lane]
        done = stats["running"] == 0 and not stats["inflight_by_class"]
        return stats if done and class_count(stats, "aborted_by_class", "interactive") > aborted_before else None

    after = wait_until(settled, timeout_s=30)
    assert after, lane_stats(app_url)[lane]
    # Aborted once, never served to its end, and the engine runs nothing any more.
    assert class_count(after, "aborted_by_class", "interactive") == aborted_before + 1
    assert (class_count(after, "served_by_class", "interactive")
            == class_count(before[lane], "served_by_class", "interactive"))


BAD_REQUESTS = [
    # (description, path, raw body or json, status, message fragment, param)
    ("malformed JSON", "/v1/chat/completions", b'{"model": "tiny-llama", "messages": [', 400, "not valid JSON", None),
    ("wrong type", "/v1/chat/completions", {"model": "tiny-llama", "messages": "hello"}, 400, "valid list",
     "messages"),
    ("wrong max_tokens type", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": "many"}, 400,
     "valid integer", "max_tokens"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "does not exist", "model"),
    ("empty prompt", "/v1/completions", {"model": "tiny-llama", "prompt": ""}, 400, "must be provided and non-empty",
     "prompt"),
    ("empty messages", "/v1/chat/completions", {"model": "tiny-llama", "messages": []}, 400, "empty conversation",
     None),
    ("over max_model_len", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 4000}, 400,
     "cannot be greater than max_model_len=2048", "max_tokens"),
    ("token id outside the vocabulary", "/v1/completions", {"model": "tiny-llama", "prompt": [99999]}, 400,
     "out of vocabulary", None),
    ("unknown request class", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "service_tier": "gold"}, 400,
     "service_tier", "service_tier"),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(app_url, served_model, case):
    _, path, payload, status, fragment, param = case
    kwargs = {"content": payload, "headers": {"content-type": "application/json"}} if isinstance(
        payload, bytes) else {"json": payload}
    response = httpx.post(f"{app_url}{path}", timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert "Traceback" not in response.text
    good = httpx.post(f"{app_url}/v1/completions", timeout=60,
                      json={"model": served_model, "prompt": "still alive", "max_tokens": 2})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] is not None


def test_unknown_request_class_header_is_refused(app_url, served_model):
    response = httpx.post(f"{app_url}/v1/completions", timeout=30, headers={"X-Request-Class": "vip"},
                          json={"model": served_model, "prompt": "x", "max_tokens": 2})
    assert response.status_code == 400 and "X-Request-Class header" in response.json()["error"]["message"]


def test_sdk_raises_typed_errors(openai_client):
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="cannot be greater than max_model_len"):
        openai_client.completions.create(model="tiny-llama", prompt="x", max_tokens=10_000)


def test_health_and_unknown_route(app_url):
    def health() -> httpx.Response:
        return httpx.get(f"{app_url}/health", timeout=10)

    # The Router reads Serve's status every 5 s: once it has, /health lists each lane's running replicas (a load
    # balancer gets 503 while the hot lane has none: a read made while the app was still deploying says so until the
    # next one, so a test run right after start-up waits for it).
    assert wait_until(lambda: health().status_code == 200, timeout_s=15), health().json()
    assert health().json()["status"] == "ok"
    # Each lane's count is that of the Router's last read: a replica that came up after it shows at the next one.
    assert wait_until(lambda: health().json()["running_replicas"].get("hot") == 1, timeout_s=15), health().json()
    assert wait_until(lambda: all(isinstance(n, int) and n >= 1 for n in health().json()["running_replicas"].values()),
                      timeout_s=15), health().json()
    missing = httpx.get(f"{app_url}/v1/nothing-here", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"

"""Decode handoff on the real CPU engines (`admission.interactive_decode_handoff_tokens: 1`): an interactive answer's
first token comes from the hot lane, the rest from the cold lane, and the client gets one answer -- the same text the
hot lane alone gives for a greedy request, with every token counted once. Its own app ("decode-handoff"),
with serve_configs/gpu-single.yaml's Ray Serve replica settings (gRPC between replicas, user code
and request routers on each replica's main loop), the combination that file ships. The hot lane has two replicas,
one kept for realtime requests (admission.realtime_reserved_hot_replicas: 1), as
serve_configs/gpu-single.yaml has on the H200. Both lanes run vLLM's multi-LoRA with two tiny adapters, whose own
tests (test_lora.py) share the app: these tests send the base model's requests."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import yaml

from app.proto.llm_lanes.v1 import llm_lanes_pb2 as pb
from app.proto.llm_lanes.v1 import llm_lanes_pb2_grpc as pb_grpc
from tests.integration.conftest import GRPC_PORT, ROOT, lane_stats, local_test_document, write_serve_config
from tests.integration.test_batch_api import batch_lines, wait_for_batch
from tests.integration.test_prefix_affinity_and_scaling import hot_replicas_report, lanes

MAX_TOKENS = 24
HOT_REPLICAS = 2
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


APP = "decode-handoff"
pytestmark = pytest.mark.app(APP)


# Rank 8 (make_tiny_lora's default). The host-memory cache holds both and, on CPU, the identity adapter the base
# model runs under (app/lanes/engine.py); one step mixes at most two.
LORA = {"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4}
ADAPTER_SEEDS = {"tiny-lora-a": 1, "tiny-lora-b": 2}


def _write_config(tmp_dir: Path, tiny_model: Path) -> Path:
    from app.tools.make_tiny_lora import make_tiny_lora

    document, args = local_test_document(tiny_model)
    args["model"]["adapters"] = []
    for name, seed in ADAPTER_SEEDS.items():
        make_tiny_lora(tiny_model, tmp_dir / name, seed)
        args["model"]["adapters"].append({"name": name, "path": str(tmp_dir / name)})
    for lane in ("hot_lane", "cold_lane"):
        args[lane]["engine"]["lora"] = dict(LORA)
    args["admission"]["interactive_decode_handoff_tokens"] = 1
    args["batch"] = {"store": str(tmp_dir / "batches.sqlite3")}
    args["hot_lane"]["deployment"]["num_replicas"] = HOT_REPLICAS
    args["admission"]["realtime_reserved_hot_replicas"] = 1
    gpu_single = yaml.safe_load((ROOT / "serve_configs" / "gpu-single.yaml").read_text())
    document["applications"][0]["runtime_env"] = gpu_single["applications"][0]["runtime_env"]
    assert "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP" in document["applications"][0]["runtime_env"]["env_vars"]
    return write_serve_config(tmp_dir / "decode-handoff.yaml", document)


@pytest.fixture(scope="module")
def handoff_app(apps):
    return apps.use(APP, _write_config, ready=hot_replicas_report(HOT_REPLICAS))


def chat(url: str, served_model: str, **fields) -> httpx.Response:
    body = {"model": served_model, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_a_streamed_interactive_answer_is_finished_by_the_cold_lane(handoff_app, served_model):
    url = handoff_app.url
    assert lane_stats(url)["cold"]["max_inflight_by_class"].get("interactive", 0) == 0
    response = chat(url, served_model, stream=True, stream_options={"include_usage": True})
    assert response.status_code == 200, response.text
    assert response.headers["x-llm-lanes-lane"] == "hot"
    assert response.headers["x-llm-lanes-degraded"] == "decode_on_cold"
    events = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [e["choices"][0] for e in events if e.get("choices")]
    finishes = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
    assert finishes == ["length"], finishes  # one end, though two engines generated it
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    # The cold engine ran the continuation (at interactive priority: it ran, it did not wait for batch).
    assert lane_stats(url)["cold"]["max_inflight_by_class"]["interactive"] == 1
    streamed = "".join(c["delta"].get("content", "") for c in choices)

    # Greedy, the same answer as the hot lane alone gives (realtime is never handed off): no token lost or repeated
    # at the boundary, and the cold lane's text goes on where the hot lane's stopped.
    whole = chat(url, served_model, service_tier="priority")
    assert whole.status_code == 200 and "x-llm-lanes-degraded" not in whole.headers
    assert whole.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert streamed == whole.json()["choices"][0]["message"]["content"]

    collected = chat(url, served_model)  # not streamed: both parts joined into one message
    assert collected.status_code == 200 and collected.headers["x-llm-lanes-degraded"] == "decode_on_cold"
    assert collected.json()["choices"][0]["message"]["content"] == streamed
    # Token counts alike; cached prompt tokens may not be: realtime runs on its own hot replica (the reserve), whose
    # prefix cache has not seen this prompt, while the interactive ones share the other.
    def counts(usage: dict) -> dict:
        return {key: value for key, value in usage.items() if key != "prompt_tokens_details"}
    assert counts(collected.json()["usage"]) == counts(whole.json()["usage"])


def test_the_rest_of_the_app_works_with_gpu_singles_serve_settings(handoff_app, served_model):
    # The Batch API (the Router's dispatcher calling the cold lane), gRPC ingress and the prefix-affinity routers'
    # PrefixCache handles, with every handle routing on its replica's own loop and calling over gRPC.
    client = openai.OpenAI(base_url=f"{handoff_app.url}/v1", api_key="unused", max_retries=0)
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(batch_lines(served_model, 6)).encode())),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = wait_for_batch(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 6, batch
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == [f"req-{i}" for i in range(6)]

    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        reply = pb_grpc.LlmLanesStub(channel).Complete(
            pb.CompletionRequest(model=served_model, prompt="tell me about lanes",
                                 sampling=pb.SamplingParams(max_tokens=8, temperature=0.0)),
            metadata=(("application", "llm-lanes"),), timeout=120)
    assert reply.text and 0 < reply.usage.completion_tokens <= 8

    # Serve refuses a handle made off the caller's loop in this mode; the routers make theirs on the loop.
    assert "could not create the PrefixCache handle" not in handoff_app.log_path.read_text(errors="replace")


def test_realtime_requests_keep_a_hot_replica_of_their_own(handoff_app, served_model):
    url = handoff_app.url
    hot_replicas = sorted(r["replica_id"] for r in lanes(url)["hot"])
    assert len(hot_replicas) == HOT_REPLICAS

    def served_by(service_tier: str) -> tuple[str, str]:
        response = chat(url, served_model, service_tier=service_tier, max_tokens=2)
        assert response.status_code == 200, response.text
        assert response.headers["x-llm-lanes-lane"] == "hot"
        return service_tier, response.headers["x-llm-lanes-replica"]

    with ThreadPoolExecutor(6) as pool:  # both classes at once, from every Router replica's point of view
        served = list(pool.map(served_by, ["priority", "default"] * 6))
    realtime = {replica for tier, replica in served if tier == "priority"}
    interactive = {replica for tier, replica in served if tier == "default"}
    # Every Router agrees on the reserved replica: the first by id takes all realtime requests and no interactive
    # ones (the other replica never refused one, so none had to fall back).
    assert realtime == {hot_replicas[0]}, served
    assert interactive == {hot_replicas[1]}, served
    routing = httpx.get(f"{url}/v1/admin/stats", timeout=10).json()["router"]["replica_routing"]["HotLane"]
    assert routing["reserve_routing"].get("preferred", 0) >= 12 and not routing["reserve_routing"].get("fallback")

"""Keys, tenants, rate limits, size limits and what listens where, on the real app: serve_configs/local.yaml with API
keys of three tenants, two Router replicas and two cold replicas (real Ray Serve, real vLLM on CPU; the losses of a
cold replica and of a Router replica, tests/integration/test_lane_loss.py, run on the same app after this module).

The rate limit is checked across both Router replicas: a limit each replica enforced on its own would let twice as
many requests through.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from app.lanes.engine_reaper import descendants, process_table
from app.proto.llm_lanes.v1 import llm_lanes_pb2 as pb
from app.proto.llm_lanes.v1 import llm_lanes_pb2_grpc as pb_grpc
from app.router.auth import hash_key
from load_tests.tenant_flood import start_flood, stop_flood
from tests.integration.conftest import (
    GRPC_PORT, HTTP_PORT, TEST_MAX_FILE_BYTES, local_test_document, running_replicas, wait_until,
    write_serve_config,
)

# The app of this module and of tests/integration/test_lane_loss.py, which kills replicas and so runs after this one.
APP = "keys-two-routers"
pytestmark = pytest.mark.app(APP)

KEY_A, KEY_B, KEY_ADMIN, KEY_LIMITED = (f"sk-test-{name}-5f1e0c9a" for name in ("a", "b", "admin", "limited"))
RATE_LIMIT_RPM = 30
ROUTERS = 2
COLD_REPLICAS = 2  # for tests/integration/test_lane_loss.py: one of two is killed
MAX_REQUEST_BYTES = 64 * 1024
APPLICATION = ("application", "llm-lanes")


def write_config(tmp_dir, tiny_model):
    document, args = local_test_document(tiny_model)
    args["cold_lane"]["engine"]["max_num_seqs"] = 8
    args["cold_lane"]["deployment"]["num_replicas"] = COLD_REPLICAS
    # Hot slots (12 - 4 realtime) / 2 Routers = 4 per Router: the tenant flood fills them with a line behind them
    # while leaving the 2 cores some room, so B's TTFT during the flood measures the turns, not a saturated host.
    args["hot_lane"]["engine"]["max_num_seqs"] = 12
    # A's flood waits in the Routers' lines (the fair-share test's subject) rather than spilling to the cold lane or
    # being refused: with the embedded 2 s target, A's surplus spilled or got 429s, whose load on the 2-core host, not
    # the line, set B's first token in the flood test's slowest runs.
    args["admission"]["interactive_ttft_slo_s"] = 30.0
    args["router"].update(num_replicas=ROUTERS, max_request_bytes=MAX_REQUEST_BYTES)
    args["batch"] = {"store": str(tmp_dir / "batches.sqlite3"), "lease_s": 5, "max_file_bytes": TEST_MAX_FILE_BYTES,
                     "window_min": 8, "window_max": 8}
    args["auth"] = {"mode": "keys", "keys": [
        {"sha256": hash_key(KEY_A), "tenant": "team-a", "classes": ["interactive", "batch"]},
        {"sha256": hash_key(KEY_B), "tenant": "team-b"},
        {"sha256": hash_key(KEY_ADMIN), "tenant": "ops", "admin": True},
        {"sha256": hash_key(KEY_LIMITED), "tenant": "team-c", "requests_per_minute": RATE_LIMIT_RPM},
    ]}
    return write_serve_config(tmp_dir / "security.yaml", document)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def replicas_running(_app=None) -> bool:
    """Both Routers and both cold replicas RUNNING."""
    return running_replicas("Router") == ROUTERS and running_replicas("ColdLane") == COLD_REPLICAS


def use_app(apps):
    """This module's app, running (also for tests/integration/test_lane_loss.py)."""
    return apps.use(APP, write_config, ready=replicas_running, headers=bearer(KEY_ADMIN))


@pytest.fixture(scope="module")
def app(apps):
    return use_app(apps)


@pytest.fixture(scope="module")
def url(app) -> str:
    return app.url


@pytest.fixture(scope="module")
def stub(app):
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        yield pb_grpc.LlmLanesStub(channel)


def complete(url: str, model: str, key: str | None, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 2, **extra},
                      headers=bearer(key) if key else {}, timeout=120)


# ---- keys ------------------------------------------------------------------------------------------------------------

def test_http_without_a_valid_key_is_401_and_a_forbidden_class_403(url, served_model):
    for key in (None, "sk-bogus"):
        answer = complete(url, served_model, key)
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"]["code"] == "invalid_api_key" and "sk-" not in answer.text
    assert complete(url, served_model, KEY_A).status_code == 200
    refused = complete(url, served_model, KEY_A, service_tier="priority")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "request_class_not_allowed"
    assert complete(url, served_model, KEY_B, service_tier="priority").status_code == 200
    # The official SDK sends the key the same way.
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_B, max_retries=0, timeout=120)
    assert sdk.completions.create(model=served_model, prompt="hi", max_tokens=2).usage.completion_tokens > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    # Load balancers need no key. Each Router replica reads the lanes' running replicas every few seconds, so one
    # that read "none running yet" at start answers 503 until its next read: poll, as a load balancer does.
    assert wait_until(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200, timeout_s=15)


def test_admin_endpoints_need_an_admin_key(url):
    assert httpx.get(f"{url}/v1/admin/stats", timeout=30).status_code == 401
    forbidden = httpx.get(f"{url}/v1/admin/stats", headers=bearer(KEY_B), timeout=30)
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "admin_key_required"
    assert httpx.get(f"{url}/v1/admin/stats", headers=bearer(KEY_ADMIN), timeout=30).status_code == 200
    lookup = httpx.post(f"{url}/v1/admin/prefix_lookup", json={"prompt": "x"}, headers=bearer(KEY_B), timeout=30)
    assert lookup.status_code == 403


def test_grpc_keys_admin_rpcs_empty_model_and_message_size(stub, served_model):
    request = pb.CompletionRequest(model=served_model, prompt="hello", sampling=pb.SamplingParams(max_tokens=2))
    for metadata in ([APPLICATION], [APPLICATION, ("authorization", "Bearer sk-bogus")]):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Complete(request, metadata=metadata, timeout=120)
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
    key_b = [APPLICATION, ("authorization", f"Bearer {KEY_B}")]
    assert stub.Complete(request, metadata=key_b, timeout=120).usage.completion_tokens > 0
    with pytest.raises(grpc.RpcError) as caught:
        stub.GetStats(pb.GetStatsRequest(), metadata=key_b, timeout=60)
    assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert stub.GetStats(pb.GetStatsRequest(), metadata=[APPLICATION, ("authorization", f"Bearer {KEY_ADMIN}")],
                         timeout=60).stats
    with pytest.raises(grpc.RpcError) as caught:
        stub.Complete(pb.CompletionRequest(prompt="hello"), metadata=key_b, timeout=60)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND  # model "" as HTTP answers it
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Complete(pb.CompletionRequest(model=served_model, prompt="x" * (10 * 1024 * 1024)), metadata=key_b,
                      timeout=60)
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - started < 10  # refused, not tokenized into a deadline


def test_http_bodies_over_the_limit_are_413(url, served_model):
    answer = complete(url, served_model, KEY_B, prompt="x" * (MAX_REQUEST_BYTES + 1))
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"


# ---- tenants ---------------------------------------------------------------------------------------------------------

def batch_content(model: str, count: int, tag: str) -> bytes:
    return "\n".join(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": model, "prompt": f"question {i}", "max_tokens": 4}})
                     for i in range(count)).encode()


def wait_for_batch(client: openai.OpenAI, batch_id: str, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    return batch


def test_files_and_batches_are_isolated_between_tenants(url, stub, served_model):
    client_a = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0, timeout=120)
    client_b = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_B, max_retries=0, timeout=120)
    upload = client_a.files.create(file=("../../etc/passwd", io.BytesIO(batch_content(served_model, 3, "a"))),
                                   purpose="batch")
    assert upload.filename == "passwd"
    batch = wait_for_batch(client_a, client_a.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                                             completion_window="24h").id)
    assert batch.status == "completed" and client_a.files.content(batch.output_file_id).text
    own_b = client_b.batches.create(
        input_file_id=client_b.files.create(file=("b.jsonl", io.BytesIO(batch_content(served_model, 1, "b"))),
                                            purpose="batch").id, endpoint="/v1/completions", completion_window="24h")
    for call in (lambda: client_b.files.retrieve(upload.id), lambda: client_b.files.content(upload.id),
                 lambda: client_b.files.content(batch.output_file_id), lambda: client_b.batches.retrieve(batch.id),
                 lambda: client_b.batches.cancel(batch.id),
                 lambda: client_b.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                                 completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [b.id for b in client_b.batches.list().data] == [own_b.id]
    assert batch.id in [b.id for b in client_a.batches.list().data] and own_b.id not in [
        b.id for b in client_a.batches.list().data]
    with pytest.raises(grpc.RpcError) as caught:
        stub.GetBatch(pb.GetBatchRequest(batch_id=batch.id, include_output=True),
                      metadata=[APPLICATION, ("authorization", f"Bearer {KEY_B}")], timeout=60)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    mine = stub.GetBatch(pb.GetBatchRequest(batch_id=batch.id, include_output=True),
                         metadata=[APPLICATION, ("authorization", f"Bearer {KEY_A}")], timeout=60)
    assert mine.output_content
    wait_for_batch(client_b, own_b.id)


# ---- rate limits -----------------------------------------------------------------------------------------------------

def test_a_rate_limit_holds_across_both_router_replicas(url, stub, served_model):
    """A flood at a key limited to 30 requests a minute: the bucket allows 30 at once plus its refill while the flood
    lasts (30 / 60 per second), for both Routers together. gRPC callers get the same x-ratelimit-* fields as
    trailing metadata."""
    requests = 3 * RATE_LIMIT_RPM
    limited_key = [APPLICATION, ("authorization", f"Bearer {KEY_LIMITED}")]
    grpc_request = pb.CompletionRequest(model=served_model, prompt="hello", sampling=pb.SamplingParams(max_tokens=1))

    def one(index):
        # Each request its own: a retry of the same one before its Retry-After is the proxy's (below), not a Router's.
        return complete(url, served_model, KEY_LIMITED, max_tokens=1, prompt=f"hello {index}")

    started = time.monotonic()
    _, call = stub.Complete.with_call(grpc_request, metadata=limited_key, timeout=120)
    grpc_limits = dict(call.trailing_metadata())
    assert grpc_limits["x-ratelimit-limit-requests"] == str(RATE_LIMIT_RPM), grpc_limits
    assert "x-ratelimit-remaining-requests" in grpc_limits and "x-ratelimit-reset-requests" in grpc_limits
    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(pool.map(one, range(requests)))
    elapsed = time.monotonic() - started
    ok = [a for a in answers if a.status_code == 200]
    limited = [a for a in answers if a.status_code == 429]
    assert len(ok) + len(limited) == requests, {a.status_code for a in answers}
    admitted = len(ok) + 1  # and the gRPC request
    allowed = RATE_LIMIT_RPM + RATE_LIMIT_RPM * elapsed / 60
    print(f"rate limit {RATE_LIMIT_RPM}/min over {ROUTERS} Routers: {admitted} admitted, {len(limited)} refused "
          f"in {elapsed:.1f} s; the bucket allows {allowed:.1f}")
    assert abs(admitted - allowed) <= 0.1 * allowed
    for answer in ok[:3]:
        assert answer.headers["x-ratelimit-limit-requests"] == str(RATE_LIMIT_RPM)
        assert "x-ratelimit-remaining-requests" in answer.headers and "x-ratelimit-reset-requests" in answer.headers
    refusal = limited[0]
    assert refusal.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refusal.headers["Retry-After"]) <= 60
    assert refusal.headers["x-ratelimit-remaining-requests"] == "0"
    # The same request again before its Retry-After: the HTTP proxy answers the same refusal without a Router
    # (app/router/refusal_replay.py); another key's request is its own.
    first = next((answer for answer in (complete(url, served_model, KEY_LIMITED, max_tokens=1) for _ in range(5))
                 if answer.status_code == 429), None)
    assert first is not None, "five requests on an empty bucket were all admitted"
    again = complete(url, served_model, KEY_LIMITED, max_tokens=1)
    assert again.status_code == 429 and again.headers.get("x-llm-lanes-replayed") == "1", again.headers
    assert again.json() == first.json() and 1 <= int(again.headers["retry-after"]) <= int(first.headers["retry-after"])
    assert again.headers["x-ratelimit-remaining-requests"] == "0"
    assert complete(url, served_model, KEY_B, max_tokens=1).status_code == 200
    # The bucket is empty now (it refills one request every 2 s): a gRPC request or two later, one is refused.
    for _ in range(3):
        try:
            stub.Complete(grpc_request, metadata=limited_key, timeout=120)
        except grpc.RpcError as error:
            grpc_refusal = error
            break
    else:
        pytest.fail("three gRPC requests on an empty bucket were all admitted")
    assert grpc_refusal.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    refused_limits = dict(grpc_refusal.trailing_metadata())
    assert refused_limits["error-code"] == "rate_limit_exceeded" and 1 <= int(refused_limits["retry-after"]) <= 60
    assert refused_limits["x-ratelimit-remaining-requests"] == "0", refused_limits
    # Other keys are not limited by it.
    assert complete(url, served_model, KEY_B).status_code == 200


# ---- what listens where ----------------------------------------------------------------------------------------------

def listening_sockets(pids: set[int]) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket in LISTEN state that a process in `pids` holds."""
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout.splitlines()
    found = []
    for line in lines:
        fields = line.split()
        owners = re.findall(r'\("([^"]+)",pid=(\d+)', line)
        if not any(int(pid) in pids for _, pid in owners):
            continue
        address, _, port = fields[3].rpartition(":")
        found.append((address.strip("[]"), int(port), owners[0][0]))
    return found


def test_http_listens_on_loopback_only_and_the_rest_is_rays_own(app):
    """local.yaml's exposure, measured: the sockets of the app's processes (`serve run` and everything under it)."""
    pids = {app.process.pid} | descendants(process_table(), [app.process.pid])
    sockets = listening_sockets(pids)
    by_port = {port: (address, process) for address, port, process in sockets}
    assert by_port[HTTP_PORT][0] == "127.0.0.1"
    assert by_port[8265][0] == "127.0.0.1"  # the Ray dashboard
    wide = sorted({(address, process) for address, _, process in sockets
                   if address not in ("127.0.0.1", "::1", "localhost")})
    print("listeners beyond loopback:", wide)
    # What listens wider is Ray's (GCS, raylet, the workers' gRPC servers, the agents, the metrics export) and
    # Serve's gRPC proxy, which binds [::] (docs/operators.md#security); no engine listens beyond loopback.
    assert wide and not [process for _, process in wide if process.startswith("VLLM")]
    assert by_port[GRPC_PORT] == ("*", "ray::ProxyActor")


# ---- fair share ------------------------------------------------------------------------------------------------------

# Tenant A's flood: 12 requests at once, twice the hot slots A may hold while B is active (all but one of each
# Router's 4), so a line of A's requests waits in each Router. Each answer is long enough to hold its slot a while.
FLOOD_CONCURRENCY = 12
FLOOD_MAX_TOKENS = 256
B_REQUESTS = 8
FLOOD_SETTLE_TIMEOUT_S = 90


def router_views(url: str, want: set[str] | None = None, timeout_s: float = 30) -> dict[str, dict]:
    """Router replica id -> its `router` stats, read through the proxy (which picks the Router) until every Router in
    `want` (default: ROUTERS of them) has answered."""
    views: dict[str, dict] = {}

    def read_all() -> bool:
        view = httpx.get(f"{url}/v1/admin/stats", headers=bearer(KEY_ADMIN), timeout=60).json()["router"]
        views[view["replica"]] = view
        return set(views) >= want if want else len(views) >= ROUTERS

    assert wait_until(read_all, timeout_s=timeout_s, interval_s=0.1), \
        f"the admin stats of {sorted(want) if want else ROUTERS} Routers did not all answer; seen {sorted(views)}"
    return views


def a_line_waits_behind_as_slots(url: str) -> bool:
    """A Router's view shows A's flood as the mechanism needs it: A holds its share of the hot slots and more of A's
    requests wait behind them."""
    view = httpx.get(f"{url}/v1/admin/stats", headers=bearer(KEY_ADMIN), timeout=60).json()["router"]["hot_slots"]
    return view["in_flight_by_tenant"].get("team-a", 0) >= view["limit"] - 1 and \
        view["waiting_by_tenant"].get("team-a", 0) > 0


def waiting(view: dict, tenant: str) -> int:
    """Requests of `tenant` waiting for a hot slot in a Router's `router` stats."""
    return view.get("hot_slots", {}).get("waiting_by_tenant", {}).get(tenant, 0)


def test_one_tenants_flood_leaves_another_tenants_requests_a_slot_without_a_wait(url, served_model):
    """Tenant A floods the hot lane past its slots from a process of its own, so a line of A's requests waits in the
    Routers; tenant B's interactive requests meanwhile take the slot a flooding tenant leaves to the others instead of
    joining A's line: each Router's `queued_by_tenant` counts at most B's first request there (before B was active
    at that Router, A could hold every slot), while A's line is there before and after B's requests. A never holds
    all of the slots of a Router where B is active. What B's TTFT gains by it is measured by load_tests/tenant_flood.py
    (docs/benchmarks.md).
    """
    flood = start_flood(url, served_model, KEY_A, FLOOD_CONCURRENCY, FLOOD_MAX_TOKENS)
    try:
        assert wait_until(lambda: a_line_waits_behind_as_slots(url), timeout_s=FLOOD_SETTLE_TIMEOUT_S,
                          interval_s=0.5), "A's flood did not fill a Router's hot slots with a line of A's behind"
        # B starts once A has a line at every Router (the proxy picks the Router of each of B's requests).
        views: dict[str, dict] = {}

        def a_line_at_every_router() -> bool:
            views.update(router_views(url))
            return all(waiting(view, "team-a") > 0 for view in views.values())

        assert wait_until(a_line_at_every_router, timeout_s=FLOOD_SETTLE_TIMEOUT_S, interval_s=0.5), \
            {router: view["hot_slots"] for router, view in views.items()}
        before = dict(views)
        routers_of_b: list[str] = []
        lanes_of_b: list[str] = []
        with httpx.Client(headers=bearer(KEY_B), timeout=120) as client_b:
            for _ in range(B_REQUESTS):
                with client_b.stream("POST", f"{url}/v1/completions", json={
                        "model": served_model, "prompt": "a short question", "max_tokens": 4,
                        "stream": True}) as answer:
                    assert answer.status_code == 200, answer.read()
                    routers_of_b.append(answer.headers["x-llm-lanes-router"])
                    lanes_of_b.append(f"{answer.headers['x-llm-lanes-lane']}:"
                                      f"{answer.headers.get('x-llm-lanes-degraded', '')}")
                    assert any(line == "data: [DONE]" for line in answer.iter_lines())
        after = router_views(url, set(before) | set(routers_of_b))
    finally:
        answers = stop_flood(flood)

    def queued(views: dict[str, dict], router: str, tenant: str) -> int:
        return views.get(router, {}).get("hot_slots", {}).get("queued_by_tenant", {}).get(tenant, 0)

    b_queued = {router: queued(after, router, "team-b") - queued(before, router, "team-b") for router in after}
    a_queued = {router: queued(after, router, "team-a") - queued(before, router, "team-a") for router in after}
    a_waiting = {router: (waiting(before[router], "team-a"), waiting(after[router], "team-a")) for router in after}
    print(f"B's {B_REQUESTS} requests: Routers {routers_of_b}, lanes {sorted(set(lanes_of_b))}; joined a line: "
          f"B {b_queued}, A {a_queued}; A waiting before and after B's requests {a_waiting}; A's answers {answers}")
    assert all(count <= 1 for count in b_queued.values()), b_queued
    # B passed a line: A's was there at every Router before B's requests (above), and still there after them at the
    # Router that served most of B's. (A Router that served one or two of B's may see A's line drain meanwhile: the
    # proxy spreads A's flood too, and its share of it can end between two looks.)
    busiest = max(set(routers_of_b), key=routers_of_b.count)
    assert min(a_waiting[busiest]) > 0, (a_waiting, routers_of_b)
    for router in set(routers_of_b):  # B is active at the Routers it used: A is capped there
        slots = after[router]["hot_slots"]
        assert slots["in_flight_by_tenant"].get("team-a", 0) < slots["limit"], slots
    # A was capped, not starved: every request of its flood that ended was answered (its line was served too).
    assert answers.get("200", 0) >= FLOOD_CONCURRENCY and not [k for k in answers if k.isdigit() and k != "200"], \
        answers


def test_a_small_batch_of_one_tenant_finishes_before_a_large_one_of_another(url, served_model):
    client_a = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0, timeout=120)
    client_b = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_B, max_retries=0, timeout=120)

    def submit(client, count, tag):
        file = client.files.create(file=(f"{tag}.jsonl", io.BytesIO(batch_content(served_model, count, tag))),
                                   purpose="batch")
        return client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")

    large = submit(client_a, 400, "large")
    # A's lines are already running when B's batch comes.
    assert wait_until(lambda: client_a.batches.retrieve(large.id).request_counts.completed > 0, timeout_s=120,
                      interval_s=0.2), "A's 400-line batch completed no line within 120 s"
    small = submit(client_b, 10, "small")
    small = wait_for_batch(client_b, small.id)
    large_now = client_a.batches.retrieve(large.id)
    print(f"B's 10 lines done when A's batch had {large_now.request_counts.completed} of 400 done")
    assert small.status == "completed" and large_now.status != "completed"
    assert wait_for_batch(client_a, large.id).status == "completed"

"""The OpenAI Files + Batches API with the official SDK, on the real cold lane."""

from __future__ import annotations

import io
import json
import time

import httpx
import openai
import pytest

from tests.integration.conftest import TEST_MAX_FILE_BYTES


def batch_lines(model: str, count: int) -> list[str]:
    return [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": model, "messages": [{"role": "user", "content": f"question {i}"}],
                                 "max_tokens": 8}}) for i in range(count)]


def wait_for_batch(client: openai.OpenAI, batch_id: str, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    batch = client.batches.retrieve(batch_id)
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(1)
        batch = client.batches.retrieve(batch_id)
    return batch


def test_sdk_batch_of_200_lines_completes_with_one_output_per_line(openai_client, served_model):
    lines = batch_lines(served_model, 200)
    bad = ["{not json", json.dumps({"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": served_model, "messages": "not a list"}}),
           json.dumps({"custom_id": "unknown-model", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}})]
    uploaded = openai_client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines + bad).encode())),
                                          purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = openai_client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h", metadata={"suite": "integration"})
    batch = wait_for_batch(openai_client, batch.id)
    assert batch.status == "completed"
    assert batch.request_counts.total == 203
    assert batch.request_counts.completed == 200 and batch.request_counts.failed == 3
    output = [json.loads(line) for line in openai_client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(200))
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)
    assert all(o["response"]["body"]["object"] == "chat.completion" for o in output)
    errors = [json.loads(line) for line in openai_client.files.content(batch.error_file_id).text.splitlines()]
    assert sorted(str(e["custom_id"]) for e in errors) == ["None", "bad-body", "unknown-model"]
    by_id = {e["custom_id"]: e for e in errors}
    assert by_id["unknown-model"]["response"]["status_code"] == 404
    listed = openai_client.batches.list(limit=5)
    assert batch.id in [b.id for b in listed.data]


def test_batch_api_errors(app_url, openai_client, served_model):
    missing = httpx.get(f"{app_url}/v1/batches/batch_nope", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{app_url}/v1/files/file-nope", timeout=10).status_code == 404
    too_big = httpx.post(f"{app_url}/v1/files", timeout=60, data={"purpose": "batch"},
                         files={"file": ("big.jsonl", b"x" * (TEST_MAX_FILE_BYTES + 1))})
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "file_too_large"
    wrong_purpose = httpx.post(f"{app_url}/v1/files", timeout=60, data={"purpose": "fine-tune"},
                               files={"file": ("a.jsonl", b"{}")})
    assert wrong_purpose.status_code == 400
    uploaded = openai_client.files.create(file=("one.jsonl", io.BytesIO(batch_lines(served_model, 1)[0].encode())),
                                          purpose="batch")
    batch = wait_for_batch(openai_client, openai_client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.status == "completed"
    with pytest.raises(openai.ConflictError):
        openai_client.batches.cancel(batch.id)
    with pytest.raises(openai.BadRequestError):
        openai_client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")


def test_the_sdk_pages_through_the_files_list_to_its_end(openai_client):
    """The SDK's iteration asks for the next page with `after` until `has_more` is false."""
    uploaded = {openai_client.files.create(file=(f"page-{i}.jsonl", io.BytesIO(b"{}\n")), purpose="batch").id
                for i in range(3)}
    newest_first = [f.id for f in openai_client.files.list(limit=1, purpose="batch")]
    assert uploaded <= set(newest_first) and len(newest_first) == len(set(newest_first))
    oldest_first = [f.id for f in openai_client.files.list(limit=2, purpose="batch", order="asc")]
    assert oldest_first == newest_first[::-1]

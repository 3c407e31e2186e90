"""What a confused or hostile client sends to the chat and completion endpoints, as hypothesis strategies: bodies with
hostile values, malformed JSON, and valid bodies at the edges of what the engine takes. Sent to the real app by
tests/integration/test_bad_input.py and to the Router's HTTP surface over fake lanes by tests/unit/test_bad_input.py.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

# ---- values: what a confused or hostile client sends ---------------------------------------------------------------

lone_surrogates = st.integers(0xD800, 0xDFFF).map(chr)
# Unicode text (any plane), lone surrogates mixed in, empty, and long runs: json.dumps escapes the surrogates as
# raw \udXXX sequences, which is how they arrive over HTTP.
texts = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.one_of(st.characters(), lone_surrogates), min_size=1, max_size=20),
    st.just(""),
    st.builds(lambda c, n: c * n, st.sampled_from(["a", "é", "🙂", " ", "\x00", "<|start|>"]),
              st.integers(500, 60_000)),
)
huge_ints = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63),
                                                                     -(2**63) - 1, 10**30, -(10**30)]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 2.0, 2.0000001, 1e308]))
scalars = st.one_of(st.none(), st.booleans(), huge_ints, floats, texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=8)


def field(valid, *invalid):
    """A field's value: a valid one half the time (so other fields' values are reached, and some bodies reach the
    engine), else anything hostile."""
    return st.one_of(valid, st.one_of(*invalid, json_values))


max_tokens = field(st.integers(1, 8), st.integers(-5, 0), huge_ints, st.sampled_from([1.5, "8", "many", True]))
sampling = {
    "max_tokens": max_tokens,
    "max_completion_tokens": max_tokens,
    "temperature": field(st.floats(0, 2), floats, st.sampled_from(["0.5", -1, 3])),
    "top_p": field(st.floats(0.01, 1), floats, st.sampled_from([0, -0.5, 1.5])),
    "stop": field(st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=3)),
                  st.sampled_from(["", [""], ["x", ""], [None], [[]], [1, 2]]), texts, st.lists(texts, max_size=5)),
    "seed": field(st.integers(-(2**63), 2**63 - 1), huge_ints, st.sampled_from([-1, 1.5, "7"])),
    "n": field(st.just(1), st.integers(-3, 5)),
    "stream": field(st.booleans(), st.sampled_from(["yes", 1, None])),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "service_tier": field(st.sampled_from([None, "auto", "default", "priority", "flex"]), texts),
    "ignore_eos": field(st.booleans()),
    "model": st.one_of(st.sampled_from(["tiny-llama"] * 9 + ["gpt-4"]), texts),
}
unknown_fields = st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k: k not in sampling), json_values,
                                 max_size=3)
token_ids = st.lists(st.one_of(st.integers(0, 2047), huge_ints, st.integers(2048, 4096), st.integers(-5, -1)),
                     max_size=40)
prompts = field(texts, token_ids, st.lists(texts, max_size=3), st.builds(lambda n: [5] * n, st.integers(2000, 5000)))
content_parts = st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                                   st.fixed_dictionaries({"type": texts}), json_values), max_size=3)
messages = field(
    st.lists(st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), texts),
         "content": st.one_of(texts, content_parts, st.none(), json_values)}), max_size=4),
    st.lists(json_values, max_size=3))


def body(prompt_field: str, prompt_values) -> st.SearchStrategy[dict]:
    """A JSON object with the model, the prompt field and a few sampling fields (each maybe hostile), maybe unknown
    fields; sometimes a required field is missing."""
    return st.builds(
        lambda required, optional, extra: {**extra, **required, **optional},
        st.fixed_dictionaries({"model": sampling["model"], prompt_field: prompt_values}).flatmap(
            lambda d: st.sampled_from([d, {k: v for k, v in d.items() if k != prompt_field}, d, d, d])),
        st.fixed_dictionaries({}, optional={k: v for k, v in sampling.items() if k != "model"}),
        unknown_fields)


def encoded(payload: dict) -> bytes:
    # ensure_ascii: every non-ASCII character, lone surrogates included, travels as a \uXXXX escape; NaN and
    # Infinity go as the bare words Python's (and Starlette's) JSON parser takes.
    return json.dumps(payload).encode()


def malformed(raw_body: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.integers(1, max(1, len(raw_body) - 1)).map(lambda cut: raw_body[:cut]),  # truncated
        st.binary(max_size=64),
        st.sampled_from([b"", b"null", b"[]", b'"x"', b"5", b"{", b"}", b"[" * 50_000, b'{"model": "tiny-llama",}',
                         b"\xff\xfe{", b'{"model": "tiny-llama", "prompt": "\xc3\x28"}',
                         b'{"model": "tiny-llama", "prompt": "a", "prompt": 5}']),
    )


@st.composite
def requests_(draw) -> tuple[str, bytes]:
    """(path, raw body): a generated chat or completion body, or something that is not one."""
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    payload = draw(body("messages", messages) if path == CHAT else body("prompt", prompts))
    raw = encoded(payload)
    if draw(st.integers(0, 9)) == 0:
        raw = draw(malformed(raw))
    return path, raw


@st.composite
def edge_requests(draw) -> tuple[str, bytes]:
    """(path, raw body): a body the Router lets through, with the edges of what the engine must take (extreme seeds,
    temperature 0 and 2, a tiny top_p, unicode stop strings, token ids at the vocabulary's ends): these reach the
    engine, where a refusal would be a lane failure before."""
    edge_text = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=30)
    fields = draw(st.fixed_dictionaries({"max_tokens": st.integers(1, 8)}, optional={
        "temperature": st.sampled_from([0, 0.0, 1e-9, 2, 2.0]) | st.floats(0, 2),
        "top_p": st.sampled_from([1e-9, 1, 0.5]) | st.floats(1e-9, 1),
        "seed": st.sampled_from([-(2**63), 2**63 - 1, -1, 0]) | st.integers(-(2**63), 2**63 - 1),
        "stop": edge_text | st.lists(edge_text, min_size=1, max_size=4),
        "stream": st.booleans(), "ignore_eos": st.booleans(),
        "service_tier": st.sampled_from(["auto", "priority", "flex"])}))
    if draw(st.booleans()):
        prompt = draw(edge_text | st.lists(st.sampled_from([0, 1, 2046, 2047]) | st.integers(0, 2047), min_size=1,
                                           max_size=30))
        return COMPLETIONS, encoded({"model": "tiny-llama", "prompt": prompt, **fields})
    return CHAT, encoded({"model": "tiny-llama", "messages": [{"role": "user", "content": draw(edge_text)}], **fields})


def generated(strategy: st.SearchStrategy, count: int) -> list[tuple[str, bytes]]:
    """`count` distinct requests (hypothesis repeats a body when only a value the encoding drops differs)."""
    found: dict[tuple[str, bytes], None] = {}

    @settings(max_examples=2 * count, phases=[Phase.generate], database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(request):
        found[request] = None

    collect()
    return list(found)[:count]

"""A generated token may hold characters JSON leaves unescaped but Python's str.splitlines takes for line ends
(U+0085, U+2028, U+2029): the Router's SSE events carry them as JSON escapes, so a client reading the stream line by
line (httpx's iter_lines) gets whole events with the same text."""

from __future__ import annotations

import asyncio
import json

import httpx

from app.router.openai_engine_client import Scope, client_events
from app.router.sse import line_safe


def event(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"text": text}]}, ensure_ascii=False) + "\n\n"


async def _iterate(items):
    for item in items:
        yield item


def test_events_are_cut_into_lines_only_at_their_ends_and_keep_their_text():
    texts = ["plain", "next\u2028line", "a\x85b", "\u2029", "tab\tand\u00e9"]

    async def collect():
        scope = Scope(launch=None)
        return [e async for e in client_events(event(texts[0]), _iterate([event(t) for t in texts[1:]]), scope)]

    events = asyncio.run(collect())
    stream = "".join(events).encode()
    lines = [line for line in httpx.Response(200, content=stream).iter_lines() if line]
    assert [json.loads(line.removeprefix("data: "))["choices"][0]["text"] for line in lines] == texts


def test_an_event_without_such_characters_is_passed_on_as_it_is():
    plain = event("nothing to escape: é ✓")
    assert line_safe(plain) is plain

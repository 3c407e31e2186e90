"""Server-sent events as the Router writes and reads them: vLLM's stream events made line-safe, and one event's
JSON. Pure: no vLLM, no Ray."""

from __future__ import annotations

import json
import re
from typing import Any

# Characters JSON leaves unescaped that Python's str.splitlines (and so httpx's iter_lines) takes for line ends: a
# generated token holding one would cut an SSE data line in two for such a client.
_LINE_BREAKING = re.compile("[\x85\u2028\u2029]")


def line_safe(event: str) -> str:
    """The SSE event with those characters as JSON escapes (the same text once parsed); they occur only inside
    JSON strings there."""
    if _LINE_BREAKING.search(event) is None:
        return event
    return _LINE_BREAKING.sub(lambda match: f"\\u{ord(match.group()):04x}", event)


def sse_json(event: str) -> dict[str, Any] | None:
    """One SSE event of vLLM's stream -> its JSON object (None for the final [DONE])."""
    data = event.removeprefix("data: ").strip()
    return None if data == "[DONE]" else json.loads(data)

"""When a request reached Serve's HTTP proxy: a header the proxy stamps, so the Router's TTFT budget counts the
proxy's share of the wait too.

Serve's HTTP proxy holds a request before the Router sees it (its own queue, then handing the body over only when
the Router asks), and on a small, overloaded host that takes up to seconds. The Router admits an interactive request
against `admission.interactive_ttft_slo_s` counted from when the request arrived; counted from the Router, the
proxy's share is invisible and the client's TTFT runs past the target while the Router's own figures meet it.

`ArrivalStamp`, one of the proxy's middlewares (app/router/proxy_middlewares.py), sets `x-llm-lanes-proxy-arrival`
to the proxy's wall clock (a client's own value of the header is replaced); without it the budget counts from the
Router's arrival.

A stamp only ever shortens its own request's budget, so a forged one harms only its sender; one from a clock far from
the Router's (different nodes) is ignored: more than `PLAUSIBLE_WAIT_S` old, or ahead of the Router's clock (read
as no wait).
"""

from __future__ import annotations

import math
import time
from typing import Any

ARRIVAL_HEADER = "x-llm-lanes-proxy-arrival"
# A longer wait than this is a clock disagreement between nodes, not a queue.
PLAUSIBLE_WAIT_S = 120.0

_HEADER_BYTES = ARRIVAL_HEADER.encode()


class ArrivalStamp:
    """ASGI middleware: stamps every HTTP request with the time it reached this server."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") == "http":
            headers = [(name, value) for name, value in scope.get("headers", ()) if name != _HEADER_BYTES]
            headers.append((_HEADER_BYTES, repr(time.time()).encode()))
            scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)


def proxy_wait_s(stamp: str | None, now: float) -> float:
    """Seconds from the proxy's stamp to `now` (wall clock) before the Router saw the request; 0 without a stamp,
    for one that is not a number, or one implausibly old (see PLAUSIBLE_WAIT_S)."""
    if not stamp:
        return 0.0
    try:
        waited = now - float(stamp)
    except ValueError:
        return 0.0
    if not math.isfinite(waited) or waited <= 0 or waited > PLAUSIBLE_WAIT_S:
        return 0.0
    return waited

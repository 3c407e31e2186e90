"""Serve's HTTP proxy stamps each request's arrival; the Router reads the stamp as the wait before it saw the request."""

import asyncio

from app.router.arrival_stamp import ARRIVAL_HEADER, PLAUSIBLE_WAIT_S, ArrivalStamp, proxy_wait_s
from app.router.proxy_middlewares import proxy_middlewares
from app.router.refusal_replay import RefusalReplay


def test_the_middleware_stamps_http_requests_and_replaces_a_clients_own_stamp():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope)

    stamp = ArrivalStamp(app)
    scope = {"type": "http", "headers": [(b"host", b"x"), (ARRIVAL_HEADER.encode(), b"1.0")]}
    asyncio.run(stamp(scope, None, None))
    asyncio.run(stamp({"type": "lifespan"}, None, None))
    headers = seen[0]["headers"]
    stamps = [value for name, value in headers if name == ARRIVAL_HEADER.encode()]
    assert len(stamps) == 1 and float(stamps[0]) > 1.0 and (b"host", b"x") in headers
    assert scope["headers"][1] == (ARRIVAL_HEADER.encode(), b"1.0")  # the caller's scope is left as it was
    assert seen[1] == {"type": "lifespan"}


def test_serve_gets_starlette_middlewares_with_the_refusal_replay_outermost():
    from starlette.middleware import Middleware

    middlewares = proxy_middlewares()
    assert [type(m) for m in middlewares] == [Middleware, Middleware]
    assert [m.cls for m in middlewares] == [ArrivalStamp, RefusalReplay]


def test_the_wait_is_the_time_since_the_stamp_unless_the_stamp_is_missing_or_implausible():
    assert proxy_wait_s("100.25", now=101.0) == 0.75
    assert proxy_wait_s(None, now=101.0) == 0.0
    assert proxy_wait_s("", now=101.0) == 0.0
    assert proxy_wait_s("soon", now=101.0) == 0.0
    assert proxy_wait_s("nan", now=101.0) == 0.0
    assert proxy_wait_s("102.0", now=101.0) == 0.0  # ahead of the Router's clock
    assert proxy_wait_s(str(101.0 - PLAUSIBLE_WAIT_S - 1), now=101.0) == 0.0  # a clock far off, not a queue

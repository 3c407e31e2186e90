"""Per-key rate limits: the shared buckets (RateLedger) and each Router's allowances (RateLimiter), several Routers
on one ledger, the 429 and its headers, and the tokens given back at the end."""

from __future__ import annotations

import asyncio

import pytest

from app.classes import RequestClass
from app.prefix_cache.rate_ledger import RateLedger
from app.router.auth import Principal
from app.router.rate_limits import RateLimited, RateLimiter, duration
from tests.fakes import FakeClock


def principal(rpm=None, tpm=None, key_id="k1") -> Principal:
    return Principal("team-a", "alice", frozenset(RequestClass), False, rpm, tpm, key_id)


def routers(ledger: RateLedger, clock, n: int = 2) -> list[RateLimiter]:
    async def exchange(orders):
        return ledger.exchange(orders)

    return [RateLimiter(exchange, clock=clock) for _ in range(n)]


async def flood(limiters, who, count, prompt=10, max_tokens=10):
    admitted, refused = 0, []
    for i in range(count):
        try:
            await limiters[i % len(limiters)].admit(who, prompt, max_tokens)
            admitted += 1
        except RateLimited as error:
            refused.append(error)
    return admitted, refused


def test_the_bucket_refills_at_the_limit_per_minute_and_grants_whole_needs_only():
    clock = FakeClock()
    ledger = RateLedger(clock=clock)
    assert ledger.exchange([("b", 60, 1, 10, 0)]) == [(10, 50.0)]
    assert ledger.exchange([("b", 60, 55, 60, 0)]) == [(0, 50.0)]  # 50 left: cannot serve a need of 55
    assert ledger.exchange([("b", 60, 40, 60, 0)]) == [(50, 0.0)]  # all it holds covers the need
    clock.advance(10)
    assert ledger.level("b", 60) == pytest.approx(10)
    assert ledger.exchange([("b", 60, 0, 0, 5)])[0] == (0, pytest.approx(15))  # given back
    clock.advance(600)
    assert ledger.level("b", 60) == 60  # never above the limit


def test_two_routers_on_one_ledger_admit_the_limit_between_them_not_each():
    clock = FakeClock()
    limiters = routers(RateLedger(clock=clock), clock)
    admitted, refused = asyncio.run(flood(limiters, principal(rpm=100), 300))
    assert admitted == 100 and len(refused) == 200
    error = refused[0]
    assert error.kind == "requests" and 1 <= int(error.headers["Retry-After"]) <= 60
    assert error.headers["x-ratelimit-limit-requests"] == "100"
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
    clock.advance(30)  # half a minute refills half the bucket
    admitted, _ = asyncio.run(flood(limiters, principal(rpm=100), 100))
    assert admitted == 50


def test_only_a_few_requests_make_a_remote_call():
    clock = FakeClock()
    calls = []
    ledger = RateLedger(clock=clock)

    async def exchange(orders):
        calls.append(orders)
        return ledger.exchange(orders)

    limiter = RateLimiter(exchange, clock=clock)
    admitted, _ = asyncio.run(flood([limiter], principal(rpm=6000), 600))
    assert admitted == 600 and len(calls) <= 600 // 120 + 1  # one exchange per 2 % of the limit


def test_tokens_count_prompt_and_max_tokens_and_unused_ones_come_back():
    clock = FakeClock()
    limiters = routers(RateLedger(clock=clock), clock, n=1)
    who = principal(tpm=1000)

    async def run():
        charge = await limiters[0].admit(who, 100, 400)
        assert charge.headers["x-ratelimit-limit-tokens"] == "1000"
        second = await limiters[0].admit(who, 100, 400)
        with pytest.raises(RateLimited) as caught:
            await limiters[0].admit(who, 100, 400)
        assert caught.value.kind == "tokens"
        charge.settle(50)  # generated 50 of 400: 350 back
        second.settle(400)
        second.settle(0)  # once only
        await limiters[0].admit(who, 100, 200)

    asyncio.run(run())


def test_a_request_larger_than_the_limit_says_so():
    limiter = routers(RateLedger(clock=FakeClock()), FakeClock(), n=1)[0]
    with pytest.raises(RateLimited, match="lower max_tokens"):
        asyncio.run(limiter.admit(principal(tpm=100), 50, 100))


def test_idle_allowances_go_back_so_another_router_can_use_them():
    clock = FakeClock()
    ledger = RateLedger(clock=clock)
    first, second = routers(ledger, clock)
    who = principal(rpm=50)

    async def run():
        assert (await flood([first], who, 29))[0] == 29
        assert first.stats()["held"] == {"k1:requests": 1}  # 2 % of 50, taken ahead
        clock.advance(2.4)  # 2 requests' worth of refill
        assert await first.return_idle() == 1
        assert first.stats()["held"] == {}
        return await flood([second], who, 100)

    admitted, _ = asyncio.run(run())
    assert admitted == 50 - 30 + 1 + 2  # the one held ahead came back


def test_an_unreachable_ledger_admits():
    async def broken(orders):
        raise ConnectionError("PrefixCache down")

    limiter = RateLimiter(broken, clock=FakeClock())
    charge = asyncio.run(limiter.admit(principal(rpm=1), 1, 1))
    assert charge.tokens is None and limiter.stats()["exchange_failures"] == 1


def test_keys_without_limits_never_call_out():
    async def never(orders):
        raise AssertionError("no call expected")

    asyncio.run(RateLimiter(never).admit(principal(), 10, 10))


@pytest.mark.parametrize("seconds, text", [(0.12, "120ms"), (1, "1s"), (17.2, "18s"), (360, "6m0s"), (61, "1m1s")])
def test_reset_durations_in_openai_format(seconds, text):
    assert duration(seconds) == text


def test_over_http_a_limited_key_gets_its_headers_then_429_with_retry_after(tmp_path):
    from fastapi.testclient import TestClient

    from app.router.auth import hash_key
    from app.router.http_api import HTTP_ROUTES, make_http_app
    from tests.fakes import make_router

    key = "sk-limited-0123456789"
    router = make_router(tmp_path, auth={"keys": [{"sha256": hash_key(key), "tenant": "a", "requests_per_minute": 3,
                                                   "tokens_per_minute": 1000}]})
    clock = FakeClock()
    router.pipeline.rate_limits = routers(RateLedger(clock=clock), clock, n=1)[0]
    app = make_http_app()
    HTTP_ROUTES["completions"](app)(router.completions)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 5}
    with TestClient(app) as client:
        answers = [client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
                   for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    first, refused = answers[0], answers[3]
    assert first.headers["x-ratelimit-limit-requests"] == "3" and first.headers["x-ratelimit-limit-tokens"] == "1000"
    assert {"x-ratelimit-remaining-requests", "x-ratelimit-reset-requests", "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens"} <= set(first.headers)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and refused.json()["error"]["type"] == "requests"
    assert refused.headers["Retry-After"] == "20" and refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert len(router.lanes["hot"].requests) == 3

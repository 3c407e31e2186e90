"""Per-key rate limits (requests and tokens per minute) that hold for the whole app, however many Router replicas.

Pure asyncio, no Ray. The buckets live in one place (app/prefix_cache/rate_ledger.py, in the PrefixCache); each
Router takes small allowances from them ahead of need and spends those locally, so the request path makes a remote
call only when its allowance runs out (about once per PREFETCH_FRACTION of a limit), and all Routers together
never admit more than the bucket gave out. What a Router holds unspent goes back after IDLE_RETURN_S, so a key's
traffic moving to another Router finds its budget there (held allowances are at most a few per cent of a limit).

Tokens are counted as prompt + max_tokens at admission, and the tokens not generated are given back when the
request ends. If the PrefixCache cannot be reached within EXCHANGE_TIMEOUT_S the request is admitted (limits are
protection, not a point of failure) and a warning is logged.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from app.prefix_cache.rate_ledger import REFILL_WINDOW_S, Order
from app.router.auth import Principal

logger = logging.getLogger(__name__)

REQUESTS, TOKENS = "requests", "tokens"
# A Router takes this share of a limit ahead of need (at least what the request needs).
PREFETCH_FRACTION = 0.02
IDLE_RETURN_S = 2.0
EXCHANGE_TIMEOUT_S = 1.0
MAX_RETRY_AFTER_S = 60

Exchange = Callable[[Sequence[Order]], Awaitable[Sequence[tuple[int, float]]]]


@dataclass
class LocalBucket:
    """This Router's view of one key's bucket: the allowance it holds, and the bucket's level when last heard."""

    bucket_id: str
    kind: str
    limit: int
    allowance: int = 0
    level: float = 0.0
    last_used: float = 0.0

    @property
    def refill_per_s(self) -> float:
        return self.limit / REFILL_WINDOW_S

    def remaining(self) -> int:
        return max(0, min(self.limit, int(self.allowance + self.level)))

    def headers(self) -> dict[str, str]:
        remaining = self.remaining()
        return {f"x-ratelimit-limit-{self.kind}": str(self.limit),
                f"x-ratelimit-remaining-{self.kind}": str(remaining),
                f"x-ratelimit-reset-{self.kind}": duration((self.limit - remaining) / self.refill_per_s)}

    def retry_after_s(self, need: int) -> int:
        deficit = need - self.remaining()
        seconds = deficit / self.refill_per_s if deficit > 0 else 1
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(seconds)))


def duration(seconds: float) -> str:
    """OpenAI's reset format: "120ms", "17s", "6m0s"."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    seconds = math.ceil(seconds)
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


class RateLimited(Exception):
    def __init__(self, kind: str, limit: int, need: int, retry_after_s: int, headers: dict[str, str]):
        too_large = need > limit
        super().__init__(
            f"this request needs {need} {kind} and the API key's limit is {limit} {kind} per minute: lower "
            "max_tokens or shorten the prompt" if too_large else
            f"rate limit reached for {kind} per minute (limit {limit}): retry in {retry_after_s} s")
        self.kind = kind
        self.headers = {**headers, "Retry-After": str(retry_after_s)}


@dataclass
class Charge:
    """What one request took from its key's buckets; `settle` gives back the tokens it did not generate."""

    tokens: LocalBucket | None = None
    prompt_tokens: int = 0
    max_tokens: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False

    def settle(self, completion_tokens: int) -> None:
        if self.settled or self.tokens is None:
            self.settled = True
            return
        self.settled = True
        self.tokens.allowance += max(0, self.max_tokens - completion_tokens)


NO_CHARGE = Charge(settled=True)


class RateLimiter:
    def __init__(self, exchange: Exchange, clock: Callable[[], float] = time.monotonic,
                 prefetch_fraction: float = PREFETCH_FRACTION):
        self.exchange = exchange
        self.clock = clock
        self.prefetch_fraction = prefetch_fraction
        self._buckets: dict[str, LocalBucket] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.exchanges = 0
        self.exchange_failures = 0

    def _bucket(self, principal: Principal, kind: str, limit: int) -> LocalBucket:
        bucket_id = f"{principal.key_id}:{kind}"
        bucket = self._buckets.get(bucket_id)
        if bucket is None or bucket.limit != limit:
            bucket = self._buckets[bucket_id] = LocalBucket(bucket_id, kind, limit, level=float(limit))
        return bucket

    async def admit(self, principal: Principal, prompt_tokens: int, max_tokens: int) -> Charge:
        """Take one request and prompt + max_tokens tokens from the key's buckets, or raise RateLimited."""
        needs = []
        if principal.requests_per_minute:
            needs.append((self._bucket(principal, REQUESTS, principal.requests_per_minute), 1))
        if principal.tokens_per_minute:
            needs.append((self._bucket(principal, TOKENS, principal.tokens_per_minute), prompt_tokens + max_tokens))
        if not needs:
            return NO_CHARGE
        if any(bucket.allowance < need for bucket, need in needs):
            lock = self._locks.setdefault(principal.key_id, asyncio.Lock())
            async with lock:
                short = [(bucket, need) for bucket, need in needs if bucket.allowance < need]
                if short and not await self._exchange(short):
                    return Charge(headers=self._headers(needs))  # the ledger is unreachable: admitted
        for bucket, need in needs:
            if bucket.allowance < need:
                raise RateLimited(bucket.kind, bucket.limit, need, bucket.retry_after_s(need), self._headers(needs))
        now = self.clock()
        for bucket, need in needs:
            bucket.allowance -= need
            bucket.last_used = now
        tokens = next((bucket for bucket, _ in needs if bucket.kind == TOKENS), None)
        return Charge(tokens, prompt_tokens, max_tokens, self._headers(needs))

    @staticmethod
    def _headers(needs: list[tuple[LocalBucket, int]]) -> dict[str, str]:
        headers: dict[str, str] = {}
        for bucket, _ in needs:
            headers.update(bucket.headers())
        return headers

    async def _exchange(self, short: list[tuple[LocalBucket, int]], give_back: bool = False) -> bool:
        orders = []
        for bucket, need in short:
            lacking = max(0, need - bucket.allowance)
            want = lacking + math.ceil(bucket.limit * self.prefetch_fraction) if lacking else 0
            returned = 0
            if give_back:
                # Out of the local allowance before the call: a request meanwhile asks for its own.
                returned, bucket.allowance = bucket.allowance, 0
            orders.append((bucket.bucket_id, bucket.limit, lacking, want, returned))
        try:
            self.exchanges += 1
            answers = await asyncio.wait_for(self.exchange(orders), timeout=EXCHANGE_TIMEOUT_S)
        except Exception as error:
            self.exchange_failures += 1
            logger.warning("rate limits: the shared buckets did not answer (%r); admitting without a limit", error)
            return False
        for (bucket, _), (granted, level) in zip(short, answers):
            bucket.allowance += granted
            bucket.level = level
        return True

    async def return_idle(self) -> int:
        """Give back the allowances no request used for IDLE_RETURN_S (run every second or so); how many."""
        cutoff = self.clock() - IDLE_RETURN_S
        idle = [(bucket, 0) for bucket in self._buckets.values() if bucket.allowance > 0 and bucket.last_used < cutoff]
        if idle:
            await self._exchange(idle, give_back=True)
        return len(idle)

    def stats(self) -> dict[str, object]:
        return {"exchanges": self.exchanges, "exchange_failures": self.exchange_failures,
                "held": {bucket_id: bucket.allowance for bucket_id, bucket in self._buckets.items()
                         if bucket.allowance}}

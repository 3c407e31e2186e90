"""The approximate prefix feed on the real CPU engine: no KV-cache events, the index learns from routing.

`prefix_cache.feed: approximate` is the fallback for engines without KV events: the Router records each long prompt
on the replica Serve routed it to, and the PrefixCache forgets an entry nobody added or looked up for
`approximate_ttl_s`. The app of tests/integration/test_overload.py ("two-hot-replicas": two hot-lane replicas, the
approximate feed with a short TTL), after that module.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import wait_until
from tests.integration.test_overload import APP, APPROXIMATE_TTL_S, use_two_hot_replicas_app
from tests.integration.test_prefix_affinity_and_scaling import (
    PREFIX_TOKENS,
    complete,
    holders,
    lanes,
    router_mirror_caught_up,
    shared_prefix_prompt,
    stats,
)

pytestmark = pytest.mark.app(APP)


@pytest.fixture(scope="module")
def approximate_app(apps):
    return use_two_hot_replicas_app(apps)


def test_routing_feeds_the_index_and_unused_entries_expire(approximate_app, served_model):
    url = approximate_app.url
    hot = lanes(url)["hot"]
    assert all(r["prefix_feed"]["mode"] == "approximate" for r in hot), hot

    for group in (70, 71):
        first = complete(url, served_model, shared_prefix_prompt(group, 0))
        assert first.status_code == 200, first.text
        holder = first.headers["x-llm-lanes-replica"]
        # Recorded where Serve routed it, not reported by the engine.
        assert wait_until(lambda: holders(url, shared_prefix_prompt(group, 0)).get(holder, 0) >= PREFIX_TOKENS,
                          timeout_s=10), holders(url, shared_prefix_prompt(group, 0))
        assert wait_until(lambda: router_mirror_caught_up(url), timeout_s=10), stats(url)["router"]
        for question in (1, 2):
            response = complete(url, served_model, shared_prefix_prompt(group, question))
            assert response.status_code == 200, response.text
            # Same replica, and its engine had the prefix cached: the approximate entry was right.
            assert response.headers["x-llm-lanes-replica"] == holder, (group, question, holder)
            assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= PREFIX_TOKENS

    # No engine was given a KV-events endpoint: the feed is the routing alone.
    assert all("events" not in r["prefix_feed"] for r in lanes(url)["hot"]), lanes(url)["hot"]
    routing = stats(url)["router"]["replica_routing"]["HotLane"]["reasons"]
    assert routing.get("affinity", 0) >= 4, routing

    # Unused for the TTL, the entries go (a lookup counts as use, so only look once they should be gone).
    entries = stats(url)["prefix_cache"]["entries"]
    assert entries > 0
    assert wait_until(lambda: stats(url)["prefix_cache"]["entries"] == 0,
                      timeout_s=APPROXIMATE_TTL_S + 20), stats(url)["prefix_cache"]
    assert holders(url, shared_prefix_prompt(70, 0)) == {}

"""Batch borrowing the hot lane's idle turns, on the real CPU engines (`admission.hot_batch_borrow_max` with
`batch.flex_waits_for_window`): a burst of flex requests fills the Router's cold share first, then the hot lane's
loans, and the rest wait in the Router; every loan comes back. Its own app (a one-line cold share, two loans),
started after every other integration module."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import local_test_document, router_stats, served_app, write_serve_config

COLD_SHARE = 1  # batch window 1, one cold replica, one Router
LOANS = 2
BURST = 8


def _write_config(tmp_dir: Path, tiny_model: Path) -> Path:
    document, args = local_test_document(tiny_model)
    args["admission"]["hot_batch_borrow_max"] = LOANS
    args["batch"] = {"store": str(tmp_dir / "batches.sqlite3"), "window_min": COLD_SHARE, "window_max": COLD_SHARE,
                     "flex_waits_for_window": True}
    return write_serve_config(tmp_dir / "hot-batch-loans.yaml", document)


@pytest.fixture(scope="module")
def loans_app(tmp_path_factory, tiny_model):
    tmp_dir = tmp_path_factory.mktemp("hot-batch-loans")
    with served_app(_write_config(tmp_dir, tiny_model), tmp_dir / "serve.log") as app:
        yield app


async def test_a_flex_burst_takes_the_cold_share_then_the_hot_loans(loans_app, served_model):
    url = loans_app.url
    async with httpx.AsyncClient(timeout=180) as client:
        responses = await asyncio.gather(*(
            client.post(f"{url}/v1/completions", json={"model": served_model, "prompt": f"count to {i}",
                                                       "max_tokens": 96, "ignore_eos": True, "service_tier": "flex"})
            for i in range(BURST)))
    assert [r.status_code for r in responses] == [200] * BURST, [r.text for r in responses if r.status_code != 200]
    lanes = Counter(r.headers["x-llm-lanes-lane"] for r in responses)
    assert lanes["cold"] >= 1 and lanes["hot"] >= 1, lanes
    assert all(r.headers.get("x-llm-lanes-degraded") == "borrowed_hot"
               for r in responses if r.headers["x-llm-lanes-lane"] == "hot")
    assert all(r.json()["usage"]["completion_tokens"] == 96 for r in responses)
    router = router_stats(url)
    # Never more in a lane than its batch slots: the rest waited in the Router, not in an engine's queue.
    assert router["batch_on_lane_peak"] == {"hot": LOANS, "cold": COLD_SHARE}, router
    assert router["hot_batch_loans"] == 0 and router["flex_waiting_for_slot"] == 0, router
    assert router["batch_on_lane"] == {"hot": 0, "cold": 0}, router

"""Contract tests of the LoRA adapter registry in the durable store, against every backend."""

from __future__ import annotations

import pytest

from app.batch.store import (
    ADAPTER_LOADING, ADAPTER_READY, ADAPTER_REFUSED, ADAPTER_UNLOADED, ConflictError, InvalidRequestError,
    NotFoundError,
)
from tests.batch_store_backends import store_factory  # noqa: F401  (fixture)
from tests.fakes import FakeClock

FIRST_ID = 1_000_000
STALE_S = 120.0


def reserve(store, name: str, path: str = "/adapters/a", replace: bool = False):
    return store.reserve_adapter(name, path, replace=replace, first_id=FIRST_ID, stale_after_s=STALE_S)


def test_a_reserved_adapter_is_served_once_settled_ready_and_no_longer_once_unloaded(store_factory):
    store = store_factory()
    record = reserve(store, "sql")
    assert (record.id, record.state) == (FIRST_ID, ADAPTER_LOADING)
    assert store.ready_adapters() == []  # a load under way is not served
    assert store.settle_adapter(record.id, ready=True).state == ADAPTER_READY
    assert [(a.id, a.name, a.path) for a in store.ready_adapters()] == [(FIRST_ID, "sql", "/adapters/a")]
    assert store.unload_adapter("sql").state == ADAPTER_UNLOADED
    assert store.ready_adapters() == []
    with pytest.raises(NotFoundError) as unknown:
        store.unload_adapter("sql")
    assert unknown.value.param == "lora_name"


def test_ids_are_never_given_twice_even_after_a_refusal_or_an_unload(store_factory):
    store = store_factory()
    first = reserve(store, "a")
    store.settle_adapter(first.id, ready=False)
    second = reserve(store, "a")
    store.settle_adapter(second.id, ready=True)
    store.unload_adapter("a")
    third = reserve(store, "a")
    assert [first.id, second.id, third.id] == [FIRST_ID, FIRST_ID + 1, FIRST_ID + 2]
    assert store.settle_adapter(first.id, ready=False).state == ADAPTER_REFUSED


def test_a_second_load_of_a_served_name_is_refused_unless_it_replaces_it(store_factory):
    store = store_factory()
    store.settle_adapter(reserve(store, "a", "/v1").id, ready=True)
    with pytest.raises(InvalidRequestError, match="already been loaded"):
        reserve(store, "a", "/v2")
    replacement = reserve(store, "a", "/v2", replace=True)
    assert [a.path for a in store.ready_adapters()] == ["/v1"]  # the old one serves until the new one is ready
    store.settle_adapter(replacement.id, ready=True)
    assert [(a.id, a.path) for a in store.ready_adapters()] == [(replacement.id, "/v2")]


def test_a_load_under_way_blocks_another_of_the_same_name_until_it_is_stale(store_factory):
    clock = FakeClock()
    store = store_factory(clock=clock)
    reserve(store, "a")
    with pytest.raises(ConflictError, match="being loaded now"):
        reserve(store, "a", replace=True)
    reserve(store, "b")  # other names are not blocked
    clock.advance(STALE_S + 1)  # its Router stopped before settling it
    assert reserve(store, "a").state == ADAPTER_LOADING


def test_every_store_object_on_the_database_sees_the_same_adapters(store_factory):
    writer, reader = store_factory(), store_factory()
    record = reserve(writer, "a")
    writer.settle_adapter(record.id, ready=True)
    assert [a.name for a in reader.ready_adapters()] == ["a"]
    writer.close()
    reopened = store_factory()  # a restart keeps the set
    assert [a.id for a in reopened.ready_adapters()] == [record.id]

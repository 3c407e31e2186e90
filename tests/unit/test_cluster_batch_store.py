"""batch.store on more than one node: a SQLite file is refused when the lanes can span nodes, and prod.yaml's
PostgreSQL store opens as written (libpq's environment supplies the connection)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from app.config import ConfigError, load_app_config, max_gpus

REPO = Path(__file__).resolve().parents[2]


def gpu_app(hot: dict, cold: dict | None, **batch) -> dict:
    args = {"device": "gpu", "model": {"source": "m", "served_name": "m", "max_model_len": 2048},
            "hot_lane": {"deployment": hot}, "cold_lane": None if cold is None else {"deployment": cold}}
    if batch:
        args["batch"] = batch
    return args


TP2 = {"engine": {"tensor_parallel_size": 2}}


@pytest.mark.parametrize("hot, cold, gpus", [
    ({"num_gpus": 0.5}, {"num_gpus": 0.5}, 1.0),  # two lanes on one GPU (gpu-single.yaml's shape)
    ({"num_gpus": 1}, None, 1.0),  # the single-pool baseline on one GPU
])
def test_sqlite_is_fine_when_the_lanes_fit_one_gpu(hot, cold, gpus):
    cfg = load_app_config(gpu_app(hot, cold))
    assert max_gpus(cfg) == gpus and not cfg.batch.is_postgres


@pytest.mark.parametrize("hot, cold, gpus", [
    ({"num_gpus": 1}, {"num_gpus": 1}, 2),  # one GPU each: two nodes of one GPU can hold them
    ({"num_gpus": 0.5, "num_replicas": 2}, {"num_gpus": 0.5, "autoscaling": {"max_replicas": 3}}, 2.5),
])
def test_sqlite_is_refused_when_the_lanes_can_span_nodes(hot, cold, gpus):
    with pytest.raises(ConfigError) as caught:
        load_app_config(gpu_app(hot, cold))
    message = str(caught.value)
    assert "batch.store='.data/batches.sqlite3' is a SQLite file" in message
    assert f"can hold {gpus:g} GPUs" in message
    assert "postgresql://" in message and "batch.single_node: true" in message  # the two fixes


def test_tensor_parallel_replicas_count_whole_gpus_at_their_largest():
    args = {"device": "gpu", "model": {"source": "m", "served_name": "m", "max_model_len": 2048},
            "hot_lane": {**TP2, "deployment": {"num_replicas": 2}},
            "cold_lane": {**TP2, "deployment": {"autoscaling": {"min_replicas": 1, "max_replicas": 4}}},
            "batch": {"store": "postgresql://db/llm_lanes"}}
    assert max_gpus(load_app_config(args)) == 12  # prod.yaml's shape: 2 x 2 hot + 4 x 2 cold


def test_postgres_or_an_explicit_single_node_lifts_the_refusal():
    two_gpus = ({"num_gpus": 1}, {"num_gpus": 1})
    assert load_app_config(gpu_app(*two_gpus, store="postgresql://llm_lanes@db:5432/llm_lanes")).batch.is_postgres
    assert load_app_config(gpu_app(*two_gpus, single_node=True)).batch.single_node


def test_cpu_configs_keep_sqlite():
    args = {"device": "cpu", "model": {"source": "m", "served_name": "m", "max_model_len": 2048},
            "hot_lane": {"engine": {"kv_cache_memory_bytes": 1 << 28}, "deployment": {"num_replicas": 3}},
            "cold_lane": {"engine": {"kv_cache_memory_bytes": 1 << 28}}}
    assert not load_app_config(args).batch.is_postgres


def prod_store() -> str:
    raw = yaml.safe_load((REPO / "serve_configs" / "prod.yaml").read_text())
    return load_app_config(raw["applications"][0]["args"]).batch.store


def test_prod_uses_postgres():
    assert prod_store().startswith("postgresql://")


def test_prod_store_opens_with_the_connection_from_libpq_environment(monkeypatch):
    """What a Ray node does with the Secret's PG* variables: open prod.yaml's store against a real PostgreSQL."""
    url = os.environ.get("LLM_LANES_TEST_POSTGRES_URL")
    if not url:
        pytest.skip("LLM_LANES_TEST_POSTGRES_URL not set (eval \"$(.ci/postgres.sh)\")")
    from app.batch.open_store import open_batch_store

    parts = urlsplit(url)
    for name in [n for n in os.environ if n.startswith("PG")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PGHOST", parts.hostname or "localhost")
    monkeypatch.setenv("PGPORT", str(parts.port or 5432))
    monkeypatch.setenv("PGDATABASE", parts.path.lstrip("/"))
    monkeypatch.setenv("PGUSER", unquote(parts.username or ""))
    if parts.password:
        monkeypatch.setenv("PGPASSWORD", unquote(parts.password))
    store = open_batch_store(prod_store())
    try:
        assert store.list_active_batches() is not None
    finally:
        store.close()

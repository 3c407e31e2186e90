"""ColdLane reports the durable backlog and its engine's queue as custom autoscaling metrics."""

import json
from types import SimpleNamespace

from app.batch.autoscaling import METRIC_BACKLOG_TOKENS, METRIC_ENGINE_WAITING, METRIC_PENDING_LINES
from app.batch.open_store import open_batch_store
from app.lanes.cold import ColdLane
from app.lanes.types import EngineStats


def test_record_autoscaling_stats_reads_the_shared_store_and_the_engine(tmp_path):
    store_path = str(tmp_path / "batches.sqlite3")
    store = open_batch_store(store_path)
    lines = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "m", "prompt": "hello", "max_tokens": 10}}) for i in range(7))
    file = store.create_file("batch", "in.jsonl", lines.encode())
    store.create_batch(file.id, "/v1/completions", "24h")

    replica = object.__new__(ColdLane.func_or_class)
    replica.cfg = SimpleNamespace(batch=SimpleNamespace(store=store_path))
    replica.engine = SimpleNamespace(stats=lambda: EngineStats(waiting=3), shutdown=lambda: None)
    stats = replica.record_autoscaling_stats()
    assert stats[METRIC_PENDING_LINES] == 7
    assert stats[METRIC_BACKLOG_TOKENS] > 7 * 10
    assert stats[METRIC_ENGINE_WAITING] == 3

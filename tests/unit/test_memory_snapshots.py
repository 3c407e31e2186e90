"""tracemalloc snapshots of a replica's heap, written on a timer, and the lines whose memory grew between two."""

import asyncio
import tracemalloc

import pytest

from app.config import ConfigError, load_app_config
from app.observability.memory import MemorySnapshots, growth, read_index, start_memory_snapshots
from tests.fakes import cpu_args

KEPT: list[bytes] = []


def grow() -> None:
    KEPT.extend(bytes(1024) + bytes([i % 256]) for i in range(2000))  # the line a leak would be


@pytest.fixture
def untraced():
    was = tracemalloc.is_tracing()
    yield
    KEPT.clear()
    if not was:
        tracemalloc.stop()


def test_the_lines_that_grew_between_two_snapshots_come_first(tmp_path, untraced):
    snapshots = MemorySnapshots(tmp_path, interval_s=600, frames=1, component="ColdLane")
    tracemalloc.start(1)
    first = snapshots.write_one()
    grow()
    last = snapshots.write_one()
    rows = growth(first, last, top=3)
    assert rows[0]["where"].endswith(f"test_memory_snapshots.py:{grow.__code__.co_firstlineno + 1}"), rows
    assert rows[0]["size_diff_kib"] >= 2000 and rows[0]["count_diff"] >= 2000
    index = read_index(tmp_path)
    assert [e["n"] for e in index] == [0, 1] and index[0]["component"] == "ColdLane"
    assert index[1]["traced_mib"] > index[0]["traced_mib"] and index[0]["rss_mib"] > 0
    assert index[1]["path"] == last.name and last.name.startswith("ColdLane-")


def test_started_in_a_replica_it_writes_a_baseline_at_once_and_stops(tmp_path, untraced):
    cfg = load_app_config({**cpu_args(), "observability": {"memory_snapshots": {"dir": str(tmp_path / "mem"),
                                                                                  "interval_s": 60}}})

    async def run():
        snapshots = start_memory_snapshots(cfg.observability.memory_snapshots, "PrefixCache")
        for _ in range(200):
            if read_index(tmp_path / "mem"):
                break
            await asyncio.sleep(0.05)
        snapshots.stop()
        return snapshots

    snapshots = asyncio.run(run())
    assert tracemalloc.is_tracing() and snapshots.written == 1
    assert [e["component"] for e in read_index(tmp_path / "mem")] == ["PrefixCache"]


def test_off_unless_a_directory_is_set_and_the_interval_must_be_positive():
    cfg = load_app_config(cpu_args())
    assert cfg.observability.memory_snapshots.dir is None
    assert start_memory_snapshots(cfg.observability.memory_snapshots, "Router") is None
    with pytest.raises(ConfigError, match="interval_s"):
        load_app_config({**cpu_args(), "observability": {"memory_snapshots": {"dir": "/tmp/x", "interval_s": 0}}})

"""Snapshots of a replica's Python heap (tracemalloc), so that a soak can say which lines hold the memory that grows.

With `observability.memory_snapshots.dir` set, every Router, lane and PrefixCache replica starts tracemalloc once it
is built (allocations made while starting are not traced: a soak asks what grows while serving) and writes a snapshot
every `interval_s` into that directory on its node: `<component>-<pid>-<n>.tracemalloc` (tracemalloc's own dump
format, `tracemalloc.Snapshot.load` reads it), and one line per snapshot in `index.jsonl` (component, pid, n, time,
the process's RSS and the traced total). `growth(first, last)` compares two snapshots line by line, largest growth
first: what `load_tests.soak --memory-snapshots` reports. Off by default: tracing every allocation costs the replica's
Python code time and memory (a soak's figures are taken with and without it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

INDEX_FILE = "index.jsonl"
SNAPSHOT_SUFFIX = ".tracemalloc"
# tracemalloc's own bookkeeping and the import machinery are not the app's memory.
_IGNORED = (tracemalloc.__file__, "<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>",
            "<unknown>")


def rss_mib(status_path: str = "/proc/self/status") -> float | None:
    try:
        with open(status_path, encoding="utf-8") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


class MemorySnapshots:
    """tracemalloc in this process, a snapshot written every `interval_s` (see the module's docstring)."""

    def __init__(self, directory: str | Path, interval_s: float, frames: int, component: str):
        self.directory = Path(directory)
        self.interval_s = interval_s
        self.frames = frames
        self.component = component
        self.written = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Trace from now on and write the first snapshot at once (the baseline), then every interval."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
        # The replica's loop: PrefixCache builds itself in a plain __init__, the others in an async one.
        self._task = asyncio.get_event_loop().create_task(self._write_forever())

    async def _write_forever(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.write_one)
            except OSError as error:  # a full or missing disk must not take the replica down
                logger.warning("memory snapshot of %s not written: %s", self.component, error)
            await asyncio.sleep(self.interval_s)

    def write_one(self) -> Path:
        snapshot = tracemalloc.take_snapshot()
        traced, _ = tracemalloc.get_traced_memory()
        path = self.directory / f"{self.component}-{os.getpid()}-{self.written:04d}{SNAPSHOT_SUFFIX}"
        snapshot.dump(str(path))
        entry = {"component": self.component, "pid": os.getpid(), "n": self.written, "t_unix": time.time(),
                 "rss_mib": rss_mib(), "traced_mib": round(traced / 2**20, 2), "path": path.name}
        with (self.directory / INDEX_FILE).open("a", encoding="utf-8") as index:
            index.write(json.dumps(entry) + "\n")
        self.written += 1
        return path

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


def start_memory_snapshots(settings: Any, component: str) -> MemorySnapshots | None:
    """The snapshots `settings` (observability.memory_snapshots) ask for, started; None when they are off."""
    if settings is None or not settings.dir:
        return None
    snapshots = MemorySnapshots(settings.dir, settings.interval_s, settings.frames, component)
    snapshots.start()
    return snapshots


def growth(first: str | Path, last: str | Path, top: int = 10) -> list[dict[str, Any]]:
    """The `top` source lines whose traced memory grew most from snapshot `first` to `last`."""
    filters = [tracemalloc.Filter(False, pattern) for pattern in _IGNORED]
    before = tracemalloc.Snapshot.load(str(first)).filter_traces(filters)
    after = tracemalloc.Snapshot.load(str(last)).filter_traces(filters)
    rows = []
    for stat in after.compare_to(before, "lineno")[:top]:
        frame = stat.traceback[0]
        rows.append({"where": f"{frame.filename}:{frame.lineno}", "size_diff_kib": round(stat.size_diff / 1024, 1),
                     "size_kib": round(stat.size / 1024, 1), "count_diff": stat.count_diff})
    return rows


def read_index(directory: str | Path) -> list[dict[str, Any]]:
    path = Path(directory) / INDEX_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

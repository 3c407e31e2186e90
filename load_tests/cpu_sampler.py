"""Which processes use the CPU while a benchmark runs: every process's CPU time from /proc, sampled once a second to
a JSON-lines file, then summed per process over a time window (in cores: CPU seconds per wall second).

    python -m load_tests.cpu_sampler record /tmp/cpu.jsonl &          # while the benchmark runs; kill it after
    python -m load_tests.cpu_sampler summarize /tmp/cpu.jsonl --from 1796342160 --to 1796342245

Ray names its workers after their actor (`ray::ServeReplica:llm-lanes:ColdLane`), vLLM its processes
(`VLLM::EngineCore`, `VLLM::Worker`), so one line per deployment and engine process comes out. Linux only. Reading
/proc once a second costs about 1 % of a core on the 2-core host (docs/history.md, batch throughput runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")  # the unit of utime and stime in /proc/<pid>/stat
CMDLINE_CHARS = 160


def process_label(comm: str, cmdline: str) -> str:
    """A stable name for a process: the Ray actor (method suffix dropped), the vLLM process, or the command."""
    first = cmdline.split(" ", 1)[0] if cmdline else ""
    if first.startswith("ray::"):
        name = first[len("ray::"):]
        head, _, last = name.rpartition(":")
        # "ServeReplica:llm-lanes:Router.handle_request" -> "ServeReplica:llm-lanes:Router"
        return f"{head}:{last.split('.', 1)[0]}" if head else last.split(".", 1)[0]
    if first.startswith("VLLM::"):
        return first  # the kernel's comm is cut at 15 characters ("VLLM::EngineCor")
    return comm


def parse_stat(text: str) -> tuple[str, float]:
    """/proc/<pid>/stat -> (comm, user + system CPU seconds)."""
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    # Fields after the comm start at "state" (field 3): utime and stime are fields 14 and 15.
    return comm, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


def snapshot(proc: Path = PROC) -> dict[int, tuple[str, float]]:
    """pid -> (label, CPU seconds so far) for every process readable now."""
    taken: dict[int, tuple[str, float]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm, cpu_s = parse_stat((entry / "stat").read_text())
            cmdline = (entry / "cmdline").read_bytes()[:CMDLINE_CHARS].replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
        taken[int(entry.name)] = (process_label(comm, cmdline.strip()), cpu_s)
    return taken


def cores_by_label(samples: Iterable[tuple[float, dict[int, tuple[str, float]]]], start: float,
                   end: float) -> tuple[float, dict[str, float]]:
    """(window seconds, label -> cores) between the first sample at or after `start` and the last at or before
    `end`. A process counts from its first sample in the window; one that started and ended between samples is
    missed, which a 1 s sampling period makes rare for the long-lived processes of a serving app."""
    inside = [(t, snap) for t, snap in samples if start <= t <= end]
    if len(inside) < 2:
        return 0.0, {}
    first_seen: dict[int, float] = {}
    last_seen: dict[int, tuple[str, float]] = {}
    for _, snap in inside:
        for pid, (label, cpu_s) in snap.items():
            first_seen.setdefault(pid, cpu_s)
            last_seen[pid] = (label, cpu_s)
    wall = inside[-1][0] - inside[0][0]
    used: Counter[str] = Counter()
    for pid, (label, cpu_s) in last_seen.items():
        used[label] += cpu_s - first_seen[pid]
    return wall, {label: cpu / wall for label, cpu in used.most_common() if cpu > 0}


def record(path: Path, period_s: float = 1.0) -> None:
    with open(path, "a", encoding="utf-8") as out:
        while True:
            now = time.time()
            out.write(json.dumps({"t": now, "p": {pid: list(v) for pid, v in snapshot().items()}}) + "\n")
            out.flush()
            time.sleep(max(0.0, period_s - (time.time() - now)))


def load(path: Path) -> list[tuple[float, dict[int, tuple[str, float]]]]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        rows.append((row["t"], {int(pid): (v[0], v[1]) for pid, v in row["p"].items()}))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.cpu_sampler", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="append a sample per period to FILE until killed")
    rec.add_argument("file", type=Path)
    rec.add_argument("--period-s", type=float, default=1.0)
    summ = sub.add_parser("summarize", help="cores per process between two unix times")
    summ.add_argument("file", type=Path)
    summ.add_argument("--from", dest="start", type=float, default=0.0)
    summ.add_argument("--to", dest="end", type=float, default=float("inf"))
    summ.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.file, args.period_s)
        return 0
    wall, cores = cores_by_label(load(args.file), args.start, args.end)
    if not cores:
        print("fewer than two samples in that window", file=sys.stderr)
        return 1
    print(f"{wall:.1f} s, {sum(cores.values()):.2f} cores in all")
    for label, used in list(cores.items())[:args.top]:
        print(f"{used:6.2f}  {label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

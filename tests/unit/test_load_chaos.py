"""load_tests.chaos and load_tests.soak: recovery times, errors by class, batch exactness, process growth, leaked
requests and the reports, from synthetic records and a fake /proc."""

from __future__ import annotations

from pathlib import Path

from load_tests.chaos import (RequestRecord, back_on_lane_s, batch_exactness, build_report, engine_processes,
                              errors_by_class, first_success_s, interactive_while_down, proxy_pids, render_markdown,
                              served_through)
from load_tests.soak import build_report as soak_report
from load_tests.soak import growth, leaked_requests, read_process, rss_slope_mib_per_h
from load_tests.soak import render_markdown as soak_markdown


def record(cls: str, start: float, e2e: float, status: int | None = 200, error: str | None = None,
           lane: str = "hot", replica: str = "llm-lanes#HotLane#old") -> RequestRecord:
    return RequestRecord("s", cls, 0, True, start, e2e_s=e2e, status=status, error=error,
                         headers={"x-llm-lanes-lane": lane, "x-llm-lanes-replica": replica})


def test_first_success_counts_only_requests_sent_after_the_kill_through_a_new_lane_replica():
    records = [record("interactive", 9.0, 2.0),                                     # sent before the kill
               record("interactive", 10.5, 1.0, replica="llm-lanes#HotLane#old"),  # the dying replica
               record("interactive", 11.0, 9.0, replica="llm-lanes#HotLane#new"),
               record("interactive", 12.0, 3.0, replica="llm-lanes#HotLane#new"),  # ends first: 15.0
               record("batch", 10.2, 0.1, lane="cold", replica="llm-lanes#ColdLane#new")]
    assert first_success_s(records, 10.0, served_through("HotLane", {"new"})) == 5.0
    assert first_success_s(records, 10.0, served_through("ColdLane", {"new"})) == 0.3
    # The Router and the PrefixCache are on every request's path: any success sent after the kill.
    assert first_success_s(records, 10.0, served_through("Router", set())) == 0.3
    assert first_success_s(records, 100.0, served_through("Router", set())) is None


def test_errors_are_counted_by_class_and_key_in_the_window_they_ended_in():
    records = [record("interactive", 1.0, 1.0, status=503, error="http: lane_unavailable"),
               record("interactive", 5.0, 1.0, error="stream: {...}"),
               record("batch", 5.0, 30.0, status=None, error="timeout: no answer"),
               record("batch", 6.0, 1.0)]
    assert errors_by_class(records, 0.0, 4.0) == {"interactive": {"503": 1}, "batch": {}}
    assert errors_by_class(records, 4.0, None) == {"interactive": {"stream": 1}, "batch": {"timeout": 1}}


def test_batch_exactness_names_lost_duplicated_and_unexpected_lines():
    assert batch_exactness(3, ["chaos-0", "chaos-1", "chaos-2"])["exact"]
    result = batch_exactness(3, ["chaos-0", "chaos-0", "chaos-2", "other"])
    assert (result["lost"], result["duplicated"], result["unexpected"], result["exact"]) == (1, 1, 1, False)
    assert result["examples"]["lost"] == ["chaos-1"]


def test_engine_processes_are_the_vllm_ones_anywhere_under_the_replica():
    table = {10: (1, "ray::ServeRepli"), 11: (10, "VLLM::EngineCor"), 12: (11, "VLLM::Worker"),
             13: (10, "python3.11"), 20: (1, "VLLM::EngineCor")}
    assert engine_processes(table, 10) == [11, 12]


def test_chaos_report_gives_each_kill_its_errors_until_the_next_and_renders():
    records = [record("interactive", 1.0, 1.0), record("interactive", 11.0, 1.0, status=503, error="http: x"),
               record("batch", 21.0, 1.0, status=None, error="transport: cut")]
    kills = [{"deployment": "HotLane", "killed_s": 10.0, "engine_pids": [1, 2], "replaced_s": 30.0,
              "first_ok_s": 31.5},
             {"deployment": "Router", "killed_s": 20.0, "engine_pids": [], "replaced_s": 3.0, "first_ok_s": None}]
    settings = {"serve_config": "x.yaml", "kill": ["HotLane", "Router"], "interactive": 2, "flex": 2,
                "interactive_tokens": 64, "flex_tokens": 64, "batch_lines": 3, "batch_max_tokens": 8}
    batch = {"id": "b", "status": "completed", "request_counts": {"completed": 3}, "finished_s": 40.0,
             "exactness": batch_exactness(3, ["chaos-0", "chaos-1", "chaos-2"])}
    report = build_report(settings, kills, records, batch)
    assert report["kills"][0]["errors"] == {"interactive": {"503": 1}, "batch": {}}
    assert report["kills"][1]["errors"] == {"interactive": {}, "batch": {"transport": 1}}
    text = render_markdown(report)
    assert "| HotLane | 10 | 2 | 30.0 | 31.5 | 503: 1 | 0 |" in text
    assert "| Router | 20 | 0 | 3.0 | – | 0 | transport: 1 |" in text
    assert "0 lost, 0 duplicated, 0 unexpected -> exact" in text


def test_process_growth_marks_a_restarted_process():
    start = {"t_unix": 0, "processes": {"Router": {"pid": 1, "rss_mib": 100.0, "open_files": 40},
                                        "HotLane": {"pid": 2, "rss_mib": 500.0, "open_files": 80}}}
    end = {"t_unix": 600, "processes": {"Router": {"pid": 1, "rss_mib": 112.5, "open_files": 41},
                                        "HotLane": {"pid": 3, "rss_mib": 480.0, "open_files": 80},
                                        "proxy": {"pid": 4, "rss_mib": 90.0, "open_files": 30}}}
    rows = growth(start, end)
    assert rows["Router"]["rss_growth_mib"] == 12.5 and rows["Router"]["open_files_growth"] == 1
    assert rows["HotLane"]["same_process"] is False
    assert "rss_growth_mib" not in rows["proxy"]
    settings = {"serve_config": "x.yaml", "minutes": 10, "interactive": 2, "flex": 2, "batch_lines": 3,
                "warmup_s": 60, "drain_s": 10}
    text = soak_markdown(soak_report(settings, start, end, leaked_requests({"lanes": {}}), [], []))
    assert "| Router | 1 | 100.0 → 112.5 | 12.5 | – | 40 → 41 | 1 |" in text
    assert "| HotLane | 3 (restarted) |" in text and "left 10 s after the load stopped: **0**" in text


def test_leaked_requests_sum_engine_queues_and_in_flight_requests_of_every_lane_replica():
    stats = {"lanes": {"hot": [{"replica_id": "h", "running": 0, "waiting": 0, "inflight_by_class": {}}],
                       "cold": [{"replica_id": "c", "running": 1, "waiting": 2,
                                 "inflight_by_class": {"batch": 3}}, {"error": "unreachable"}]}}
    leaks = leaked_requests(stats)
    assert leaks["total"] == 6
    assert {r["replica_id"]: (r["running"], r["waiting"], r["in_flight"]) for r in leaks["replicas"]} == \
        {"h": (0, 0, 0), "c": (1, 2, 3)}


def test_read_process_reads_rss_and_open_files(tmp_path: Path):
    (tmp_path / "7" / "fd").mkdir(parents=True)
    (tmp_path / "7" / "status").write_text("Name:\tx\nVmRSS:\t  2048 kB\n")
    for fd in range(3):
        (tmp_path / "7" / "fd" / str(fd)).touch()
    assert read_process(7, tmp_path) == {"rss_mib": 2.0, "open_files": 3}
    assert read_process(8, tmp_path) is None


def test_proxies_are_found_by_their_process_title(tmp_path: Path):
    for pid, title in ((5, b"ray::ProxyActor\x00"), (6, b"ray::ServeReplica:llm-lanes:Router\x00"), (7, b"")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(title)
    assert proxy_pids(tmp_path) == [5]


def test_rss_trend_is_the_slope_over_the_second_half_of_one_process():
    def at(hours: float, rss: float, pid: int = 1) -> dict:
        return {"t_unix": hours * 3600, "processes": {"Router": {"pid": pid, "rss_mib": rss, "open_files": 1}}}

    # Climbs fast at first, then 10 MiB/h: only the second half counts.
    samples = [at(0, 100), at(0.25, 200), at(0.5, 300), at(0.75, 302.5), at(1.0, 305)]
    assert rss_slope_mib_per_h(samples, "Router") == 10.0
    # A restarted process (another pid at the end) has no trend from the old one's samples.
    assert rss_slope_mib_per_h(samples[:-1] + [at(1.0, 50, pid=2)], "Router") is None
    assert rss_slope_mib_per_h(samples, "proxy") is None


def test_interactive_requests_while_a_lane_is_replaced_are_counted_with_their_ttft_and_lane():
    def degraded(start: float, e2e: float, ttft: float, **kw) -> RequestRecord:
        r = record("interactive", start, e2e, lane="cold", **kw)
        r.ttft_s, r.headers["x-llm-lanes-degraded"] = ttft, "hot_lane_down"
        return r

    under_way = record("interactive", 9.0, 2.0)  # resumed: ended fine after the kill at 10
    records = [under_way, degraded(10.5, 1.0, 0.2), degraded(12.0, 1.0, 0.4),
               record("interactive", 13.0, 5.0, status=503, error="http: hot_lane_down", lane=""),
               record("interactive", 40.0, 1.0),  # after the replacement ran (30 s after the kill)
               record("batch", 11.0, 1.0, lane="cold")]
    down = interactive_while_down(records, 10.0, 30.0)
    assert down["sent"] == 3 and down["answered"] == 2 and down["answered_share"] == 0.6667
    assert down["ttft_ms"]["count"] == 2 and down["served_on"] == {"cold (hot_lane_down)": 2}
    assert down["under_way_at_kill"] == 1 and down["under_way_finished"] == 1
    assert interactive_while_down(records, 10.0, None)["sent"] == 4  # never replaced: to the end
    # Back on the hot lane: the first interactive request sent after RUNNING (at 40) that the hot lane answered.
    late = degraded(40.5, 1.0, 0.3)  # still sent to the cold lane after RUNNING
    assert back_on_lane_s(records + [late, record("interactive", 41.5, 1.0)], 10.0, 30.0) == 0.0
    assert back_on_lane_s([late, record("interactive", 42.5, 1.0)], 10.0, 30.0) == 2.5
    assert back_on_lane_s(records, 10.0, None) is None and back_on_lane_s([late], 10.0, 30.0) is None


def _keep_allocations(kept: list) -> None:
    kept.extend(bytearray(2048) for _ in range(1000))


def test_the_soak_names_the_lines_whose_traced_memory_grew_in_each_replica(tmp_path):
    import tracemalloc

    from app.observability.memory import MemorySnapshots
    from load_tests.soak import traced_growth

    kept = []
    was_tracing = tracemalloc.is_tracing()
    tracemalloc.start(1)
    try:
        snapshots = MemorySnapshots(tmp_path, interval_s=60, frames=1, component="PrefixCache")
        snapshots.write_one()  # before the start sample: not the baseline
        start_unix = __import__("time").time()
        snapshots.write_one()
        _keep_allocations(kept)
        snapshots.write_one()
    finally:
        if not was_tracing:
            tracemalloc.stop()
    [row] = traced_growth(tmp_path, start_unix, top=2)
    assert row["component"] == "PrefixCache" and row["snapshots"] == 3
    assert row["traced_mib_last"] - row["traced_mib_first"] >= 1.5
    assert row["lines"][0]["where"].endswith(f"test_load_chaos.py:{_keep_allocations.__code__.co_firstlineno + 1}")
    settings = {"serve_config": "x.yaml", "minutes": 10, "interactive": 2, "flex": 2, "batch_lines": 3,
                "warmup_s": 60, "drain_s": 10}
    sample = {"t_unix": 0, "processes": {}}
    text = soak_markdown(soak_report(settings, sample, sample, leaked_requests({"lanes": {}}), [], [], memory=[row]))
    assert "Traced Python heap of PrefixCache" in text and "| `" in text and len(kept) == 1000

"""load_tests.ttft_breakdown: a streamed request's TTFT split into the hops of the request path, from span dicts as
the app's file exporter writes them (app.observability.tracing.span_to_dict)."""

from __future__ import annotations

import json

import pytest

from load_tests import ttft_breakdown as tb

MS = 1_000_000


def span(name, trace, span_id, parent, start_ms, end_ms, **attributes):
    return {"name": name, "trace_id": trace, "span_id": span_id, "parent_span_id": parent,
            "start_time_ns": int(start_ms * MS), "end_time_ns": int(end_ms * MS), "attributes": attributes}


def streamed_request(trace: str, request_class: str, t0: float = 0.0, lanes: int = 1, streamed: bool = True):
    """Router: request 0-100 (route ends at 2, first chunk at 40); lane 1: arrives at 7, engine at 7.5, first chunk
    at 37; a handed-off request's second lane call starts at 45."""
    spans = [
        span("request", trace, "r", None, t0, t0 + 100, **{"llm_lanes.request_class": request_class}),
        span("classify", trace, "c", "r", t0 + 0.2, t0 + 1.0),
        span("route", trace, "ro", "r", t0 + 1.5, t0 + 2.0),
        span("queue_wait", trace, "q", "r", t0 + 1.2, t0 + 40),
        span("lane_generate", trace, "l1", "r", t0 + 7, t0 + 45, **{"llm_lanes.streamed": streamed}),
        span("engine_queue", trace, "e1", "l1", t0 + 7, t0 + 7.5),
        span("prefill", trace, "p1", "l1", t0 + 7.5, t0 + 37),
        span("decode", trace, "d1", "l1", t0 + 37, t0 + 45),
    ]
    if lanes == 2:
        spans += [span("lane_generate", trace, "l2", "r", t0 + 45, t0 + 99, **{"llm_lanes.streamed": True}),
                  span("engine_queue", trace, "e2", "l2", t0 + 45, t0 + 45.1),
                  span("prefill", trace, "p2", "l2", t0 + 45.1, t0 + 70)]
    return spans


def test_one_request_splits_into_its_hops():
    request_class, segments, started_ns = tb.request_segments(streamed_request("t1", "realtime", t0=5))
    assert request_class == "realtime" and started_ns == 5 * MS
    assert segments == pytest.approx({"router_work": 2.0, "hop_to_lane": 5.0, "lane_wait": 0.5,
                                      "engine_first_token": 29.5, "hop_back": 3.0, "ttft_at_router": 40.0})


def test_a_handed_off_request_counts_its_first_lane_call():
    _, segments, _ = tb.request_segments(streamed_request("t1", "interactive", lanes=2))
    assert segments["engine_first_token"] == pytest.approx(29.5) and segments["hop_to_lane"] == pytest.approx(5.0)


def test_breakdown_per_class_leaves_out_incomplete_and_unstreamed_requests():
    spans = (streamed_request("a", "realtime") + streamed_request("b", "realtime", t0=1000)
             + streamed_request("c", "batch", streamed=False)
             + [s for s in streamed_request("d", "interactive") if s["name"] != "prefill"])  # aborted before 1st
    breakdown = tb.ttft_breakdown(spans)
    assert list(breakdown) == ["realtime"] and breakdown["realtime"]["requests"] == 2
    assert breakdown["realtime"]["hop_back"] == {"p50": 3.0, "p90": 3.0, "p99": 3.0}
    table = tb.format_breakdown(breakdown)
    assert "| realtime | 2 | 2.0 / 2.0 | 5.0 / 5.0 | 0.5 / 0.5 | 29.5 / 29.5 | 3.0 / 3.0 | 40.0 / 40.0 |" in table


def test_since_leaves_out_the_requests_sent_before_the_measurement(tmp_path, capsys):
    # The GPU campaign's readiness probes (idle GPU) precede the scenario in the same span file.
    spans = streamed_request("probe", "realtime", t0=0) + streamed_request("measured", "realtime", t0=2000)
    assert tb.ttft_breakdown(spans)["realtime"]["requests"] == 2
    assert tb.ttft_breakdown(spans, since_ns=2000 * MS)["realtime"]["requests"] == 1
    path = tmp_path / "spans.jsonl"
    path.write_text("\n".join(json.dumps(s) for s in spans) + "\n")
    assert tb.main([str(path), "--since", "1.5"]) == 0  # unix seconds: 1.5 s = 1500 ms
    assert "| realtime | 1 |" in capsys.readouterr().out


def test_cli_reads_a_span_file_with_torn_lines(tmp_path, capsys):
    path = tmp_path / "spans.jsonl"
    lines = [json.dumps(s) for s in streamed_request("a", "interactive")] + ['{"name": "torn']
    path.write_text("\n".join(lines) + "\n")
    assert tb.main([str(path), "--json", str(tmp_path / "out.json")]) == 0
    assert "| interactive | 1 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text())["interactive"]["requests"] == 1


def test_cli_says_when_nothing_could_be_measured(tmp_path, capsys):
    empty = tmp_path / "spans.jsonl"
    empty.write_text("")
    assert tb.main([str(empty)]) == 1 and "sample_ratio 1.0" in capsys.readouterr().out
    assert tb.main([str(tmp_path / "missing.jsonl")]) == 2

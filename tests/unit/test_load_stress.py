"""load_tests/stress.py: the scenarios' commands and the one report built from the tools' own reports."""

from __future__ import annotations

import json

from load_tests import stress


def overload_report(held: int, idle: int, refused: int, other_errors: dict[str, int], replayed: int = 0) -> dict:
    return {
        "records": {"burst": [{"status": 429, "headers": {"x-llm-lanes-replayed": "1"}}] * replayed
                    + [{"status": 429, "headers": {}}, {"status": 200, "headers": {"x-llm-lanes-lane": "hot"}}]},
        "settings": {"burst_s": 40.0, "autogroup": False,
                     "generators": {"burst": [{"on_cpu_per_s": 0.5, "runqueue_wait_per_s": 0.25}]}},
        "headline": {"interactive_ttft_p50_ms": 800.0, "interactive_ttft_p99_ms": 2900.0, "interactive_admitted": 150,
                     "interactive_tpot_p50_ms": 40.0, "interactive_tpot_p99_ms": 95.5,
                     "samples_interactive_held": held, "samples_held_while_hot_running_none": idle,
                     "samples_waiting_for_hot_slot": 4, "samples_waiting_for_hot_slot_while_hot_running_none": 0,
                     "server_errors_5xx": 0},
        "phases": {"burst": {"window_s": 40.0, "classes": {
            "interactive": {"rejected_429": refused, "other_errors": other_errors},
            "batch": {"rejected_429": 0, "other_errors": {}}}}},
    }


def chaos_report() -> dict:
    return {"kills": [{"deployment": "HotLane", "replaced_s": 41.9, "interactive_back_on_hot_s": 1.25,
                       "errors": {"interactive": {}, "batch": {"503": 1}},
                       "interactive_while_down": {"sent": 213, "answered": 213, "ttft_ms": {"p50": 198, "p99": 2852},
                                                  "under_way_at_kill": 4, "under_way_finished": 4}}]}


def test_the_report_has_a_row_per_storm_and_per_kill(tmp_path):
    (tmp_path / "storm-naive").mkdir()
    (tmp_path / "storm-naive" / "report.json").write_text(json.dumps(overload_report(10, 1, 4000, {"stream": 2},
                                                                                              replayed=1000)))
    (tmp_path / "kills").mkdir()
    (tmp_path / "kills" / "report.json").write_text(json.dumps(chaos_report()))
    report = stress.build_report("serve_configs/local.yaml", tmp_path, ["storm-naive", "kills", "storm-polite"])
    storm, kill = report["rows"]
    assert storm["hot_running_while_held_share"] == 0.9 and storm["refusals_per_s"] == 100.0
    assert storm["refusals_replayed_share"] == 0.25
    assert storm["failures"] == {"interactive": {"stream": 2}, "flex": {}}
    assert kill["scenario"] == "kill -9 HotLane" and kill["streams_under_way_finished"] == 4
    assert kill["server_errors_5xx"] == 1 and kill["failures"]["flex"] == {"503": 1}
    assert [m["scenario"] for m in report["missing"]] == ["storm-polite"]
    markdown = stress.render_markdown(report)
    assert ("| storm-naive | 800 / 2,900 | 40.0 / 95.5 | 150 | 90 % of 10 | 100 % of 4 | 100.0 (25 %) | 0 | "
            "interactive stream: 2 | "
            "0.50 / 0.25 |") in markdown
    assert "| kill -9 HotLane | 213 | 213 | 198 / 2852 | 41.9 | 1.2 | 4 of 4 | 1 | flex 503: 1 |" in markdown


def test_the_fuzz_row_counts_what_was_a_4xx_idle_and_a_429_under_load(tmp_path):
    from load_tests.fuzz_load import compare

    result = compare([400, 422, 200, 200, 404, 413], [400, 429, 429, 200, 200, 503])
    assert result["client_error_idle_429_loaded"] == 1 and result["ok_idle_429_loaded"] == 1
    assert result["other_changes"] == {"404->200": 1, "413->503": 1} and result["server_errors"]["loaded"] == 1
    (tmp_path / "fuzz-under-load").mkdir()
    (tmp_path / "fuzz-under-load" / "report.json").write_text(json.dumps(
        {"result": result, "slots_full_before": True, "slots_full_after": True}))
    report = stress.build_report("c.yaml", tmp_path, ["fuzz-under-load"])
    assert report["rows"][0]["client_error_idle_429_loaded"] == 1
    assert "| under load | 6 | **1** | 1 | 404->200: 1, 413->503: 1 | yes | 1 |" in stress.render_markdown(report)


def test_naive_clients_retry_without_waiting_for_retry_after_and_the_kills_run_with_two_routers():
    args = stress.argparse.Namespace(serve_config="c.yaml", overrides=["x=1"], interactive=160, flex=16, burst_s=40.0,
                                     sample_interval=1.0, chaos_interactive=4, chaos_flex=2, batch_lines=100)
    naive = stress.scenario_command("storm-naive", args, tmp := stress.Path("/o"))
    polite = stress.scenario_command("storm-polite", args, tmp)
    flood = stress.scenario_command("storm-flood", args, tmp)
    assert "load_tests.fuzz_load" in stress.scenario_command("fuzz-under-load", args, tmp)
    kills = stress.scenario_command("kills", args, tmp)
    assert naive[naive.index("--resend-refused-after") + 1] == "0.2" and "--no-wait-on-refusal" not in naive
    assert "--no-wait-on-refusal" in flood and "--resend-refused-after" not in flood
    assert "--no-wait-on-refusal" not in polite and "--resend-refused-after" not in polite
    assert naive[naive.index("--set") + 1] == "x=1"
    assert "load_tests.chaos" in kills and "router.num_replicas=2" in kills and "HotLane,ColdLane,Router" in kills

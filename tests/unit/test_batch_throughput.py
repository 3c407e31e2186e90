"""The batch-throughput benchmark's pure parts: the batch, the output check, the report (no Ray, no vLLM)."""

from __future__ import annotations

import pytest

from load_tests.batch_throughput import (
    TARGET_BATCH_API_VS_BARE_ENGINE,
    batch_input_lines,
    build_report,
    check_batch_output,
    make_prompts,
    occupancy_sample,
    render_markdown,
    settings_label,
    summarize_occupancy,
    with_batch_store,
)

TOKEN_IDS = list(range(4, 2048))


def test_prompts_are_deterministic_and_within_bounds():
    first = make_prompts(7, 50, 32, 64, TOKEN_IDS)
    assert first == make_prompts(7, 50, 32, 64, TOKEN_IDS)
    assert len(first) == 50
    assert all(32 <= len(p) <= 64 for p in first)
    assert all(set(p) <= set(TOKEN_IDS) for p in first)
    assert len({len(p) for p in first}) > 1  # lengths vary
    assert make_prompts(8, 50, 32, 64, TOKEN_IDS) != first


def test_warmup_prompts_differ_from_measured_ones():
    measured = make_prompts(7, 4, 32, 64, TOKEN_IDS)
    warmup = make_prompts(7, 4, 32, 64, TOKEN_IDS, salt="warmup")
    # No shared first block: warm-up leaves nothing in the prefix cache that the measured batch could hit.
    assert {tuple(p[:32]) for p in measured}.isdisjoint({tuple(p[:32]) for p in warmup})


def test_prompts_reject_bad_bounds():
    with pytest.raises(ValueError):
        make_prompts(7, 3, 10, 5, TOKEN_IDS)
    with pytest.raises(ValueError):
        make_prompts(7, 3, 1, 5, [])


def test_batch_lines_are_completions_with_token_prompts():
    lines = batch_input_lines([[5, 6, 7], [8]], "tiny-llama", 256, 0.0)
    assert [line["custom_id"] for line in lines] == ["line-0", "line-1"]
    assert lines[0] == {"custom_id": "line-0", "method": "POST", "url": "/v1/completions",
                        "body": {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 256, "ignore_eos": True,
                                 "temperature": 0.0}}
    assert batch_input_lines([[1]], "m", 8, 0.0, id_prefix="warmup")[0]["custom_id"] == "warmup-0"


def output_line(custom_id: str, completion_tokens: int = 256, status: int = 200) -> dict:
    return {"id": f"r-{custom_id}", "custom_id": custom_id, "error": None,
            "response": {"status_code": status, "request_id": "",
                         "body": {"usage": {"prompt_tokens": 40, "completion_tokens": completion_tokens}}}}


def test_output_check_counts_tokens_when_every_id_is_back_once():
    check = check_batch_output([output_line("line-1"), output_line("line-0")], ["line-0", "line-1"], 256)
    assert check["each_id_once"] and check["lines"] == 2
    assert check["output_tokens"] == 512 and check["prompt_tokens"] == 80
    assert check["missing"] == check["duplicated"] == check["not_ok"] == check["wrong_length"] == []


def test_output_check_finds_missing_duplicated_unexpected_failed_and_short_lines():
    lines = [output_line("line-0"), output_line("line-0"), output_line("stray"), output_line("line-2", 10),
             output_line("line-3", status=500)]
    check = check_batch_output(lines, ["line-0", "line-1", "line-2", "line-3"], 256)
    assert not check["each_id_once"]
    assert check["missing"] == ["line-1"]
    assert check["duplicated"] == ["line-0"]
    assert check["unexpected"] == ["stray"]
    assert check["wrong_length"] == ["line-2"]
    assert check["not_ok"] == ["line-3"]
    assert check["output_tokens"] == 256 * 3 + 10  # the failed line's usage is not counted


ENGINES = {
    "hot": {"max_num_seqs": 32, "max_num_batched_tokens": 4096, "cpu_threads_bind": "0"},
    "cold": {"max_num_seqs": 64, "max_num_batched_tokens": 8192, "cpu_threads_bind": "1"},
}
SETTINGS = {"serve_config": "serve_configs/local.yaml", "prompts": 4, "min_prompt_tokens": 32,
            "max_prompt_tokens": 64, "max_tokens": 256, "temperature": 0.0, "seed": 7}


def report_for(*rounds: dict) -> dict:
    return build_report(SETTINGS, "2026-12-02T00:00:00+00:00", "2026-12-02T00:05:00+00:00", {"cpus": 2}, ENGINES,
                        {"window_min": 16, "window_max": 32}, list(rounds))


def one_round(cold_s: float, batch_s: float, hot_s: float = 2.0) -> dict:
    return {"offline_cold": {"engine": "cold", "requests": 4, "output_tokens": 1024, "seconds": cold_s},
            "offline_hot": {"engine": "hot", "requests": 4, "output_tokens": 1024, "seconds": hot_s},
            "batch_api": {"engine": "cold", "requests": 4, "output_tokens": 1024, "seconds": batch_s}}


def test_report_gives_rates_and_both_ratios():
    report = report_for({
        "offline_cold": {"engine": "cold", "requests": 4, "output_tokens": 1024, "seconds": 1.0},
        "offline_hot": {"engine": "hot", "requests": 4, "output_tokens": 1024, "seconds": 2.0},
        "batch_api": {"engine": "cold", "requests": 4, "output_tokens": 1024, "seconds": 1.6,
                      "check": check_batch_output([output_line(f"line-{i}") for i in range(4)],
                                                  [f"line-{i}" for i in range(4)], 256),
                      "occupancy": summarize_occupancy([{"batch_window": 16, "cold_running": 15, "cold_waiting": 0},
                                                        {"batch_window": 17, "cold_running": 17, "cold_waiting": 1}])},
    })
    assert report["rounds"][0]["runs"]["offline_cold"]["output_tokens_per_s"] == 1024
    assert report["rounds"][0]["runs"]["offline_hot"]["output_tokens_per_s"] == 512
    assert report["ratios"]["offline_cold_vs_offline_hot"] == 2.0
    assert report["ratios"]["batch_api_vs_offline_cold"] == pytest.approx(0.625)
    assert report["target"] == {"batch_api_vs_offline_cold_min": TARGET_BATCH_API_VS_BARE_ENGINE, "met": False}
    markdown = render_markdown(report)
    assert "| (a) bare engine, cold-lane settings | max_num_seqs 64, max_num_batched_tokens 8192, cores 1 | 4 | " \
           "1,024 | 1.00 | 1,024.0 |" in markdown
    assert "Router window 16-32 in flight" in markdown
    assert "**0.62×**" in markdown and "not met" in markdown and "**2.00×**" in markdown
    assert "every custom_id once: yes" in markdown
    assert "Router batch window mean 16.5 (max 17), cold engine running mean 16.0 (max 17)" in markdown


def test_report_keeps_going_when_a_run_failed():
    report = report_for({
        "offline_cold": {"engine": "cold", "error": "exit 1: boom"},
        "offline_hot": {"engine": "hot", "requests": 4, "output_tokens": 1024, "seconds": 2.0},
        "batch_api": {"engine": "cold", "requests": 4, "output_tokens": 1024, "seconds": 1.0},
    })
    assert report["rounds"][0]["runs"]["offline_cold"]["output_tokens_per_s"] is None
    assert report["ratios"] == {"batch_api_vs_offline_cold": None, "offline_cold_vs_offline_hot": None}
    assert report["target"]["met"] is None
    assert "failed: exit 1: boom" in render_markdown(report)


def test_rounds_are_paired_and_the_report_judges_their_median():
    # The machine's speed drifts: round 2 is twice as slow on both sides, so its ratio matches round 1's.
    report = report_for(one_round(cold_s=1.0, batch_s=1.25), one_round(cold_s=2.0, batch_s=2.5, hot_s=4.0),
                        one_round(cold_s=1.0, batch_s=2.0))
    assert [r["ratios"]["batch_api_vs_offline_cold"] for r in report["rounds"]] == pytest.approx([0.8, 0.8, 0.5])
    assert report["ratios"]["batch_api_vs_offline_cold"] == pytest.approx(0.8)
    assert report["ratio_spread"]["batch_api_vs_offline_cold"] == pytest.approx(
        {"median": 0.8, "min": 0.5, "max": 0.8, "rounds": 3})
    assert report["target"]["met"] is True
    markdown = render_markdown(report)
    assert "3 rounds, each run in turn in every round" in markdown
    assert "| 2 | (a) bare engine, cold-lane settings |" in markdown
    assert "median of 3 rounds, each round: 0.80×, 0.80×, 0.50×" in markdown


def test_median_of_an_even_number_of_rounds_skips_failed_ones():
    failed = one_round(cold_s=1.0, batch_s=1.0)
    failed["batch_api"] = {"engine": "cold", "error": "batch ended failed"}
    report = report_for(one_round(cold_s=1.0, batch_s=2.0), failed, one_round(cold_s=1.0, batch_s=1.0))
    assert report["ratio_spread"]["batch_api_vs_offline_cold"] == pytest.approx(
        {"median": 0.75, "min": 0.5, "max": 1.0, "rounds": 2})


def test_settings_label_leaves_out_an_unpinned_engine():
    assert settings_label({"max_num_seqs": 8, "max_num_batched_tokens": 512, "cpu_threads_bind": None}) == \
        "max_num_seqs 8, max_num_batched_tokens 512"


def test_settings_label_says_where_each_engine_process_runs():
    assert settings_label({"max_num_seqs": 8, "max_num_batched_tokens": 512, "cpu_threads_bind": "1",
                           "cpu_engine_core_bind": "1", "cpu_frontend_bind": "0"}) == \
        "max_num_seqs 8, max_num_batched_tokens 512, cores 1, engine core on 1, frontend on 0"


def test_derived_config_only_moves_the_batch_store():
    base = {"applications": [{"name": "llm-lanes", "import_path": "app.main:build_app",
                              "args": {"device": "cpu", "batch": {"store": ".data/b.sqlite3", "window_max": 32}}}]}
    derived = with_batch_store(base, "/tmp/fresh.sqlite3")
    assert derived["applications"][0]["args"]["batch"] == {"store": "/tmp/fresh.sqlite3", "window_max": 32}
    assert base["applications"][0]["args"]["batch"]["store"] == ".data/b.sqlite3"


def test_occupancy_sample_sums_the_cold_replicas_and_skips_errors():
    stats = {"lanes": {"hot": [{"running": 9, "waiting": 9}],
                       "cold": [{"running": 12, "waiting": 3}, {"running": 4, "waiting": 0}, {"error": "gone"}]},
             "router": {"batch_window": 18, "batch_in_flight": 17}}
    assert occupancy_sample(stats) == {"batch_window": 18, "batch_in_flight": 17, "cold_running": 16,
                                       "cold_waiting": 3}
    assert occupancy_sample({}) == {"batch_window": None, "batch_in_flight": None, "cold_running": 0,
                                    "cold_waiting": 0}


def test_occupancy_summary_of_no_samples_is_empty():
    assert summarize_occupancy([]) == {"samples": 0, "batch_window_mean": None, "batch_window_max": None,
                                       "batch_in_flight_mean": None, "batch_in_flight_max": None,
                                       "cold_running_mean": None, "cold_running_max": None,
                                       "cold_waiting_mean": None, "cold_waiting_max": None}


def test_report_without_the_hot_run_leaves_its_ratio_out():
    runs = one_round(cold_s=1.0, batch_s=2.0)
    del runs["offline_hot"]
    markdown = render_markdown(report_for(runs, dict(runs)))
    assert "cold-lane ÷ hot-lane" not in markdown and "**0.50×**" in markdown

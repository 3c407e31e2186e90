"""load_tests/tenant_flood.py without an app: the served config gets the run's keys (hashed) and its own batch
store, the report says the phases and the ratio, and --url without the keys is refused naming them."""

from __future__ import annotations

import pytest
import yaml

from app.router.auth import hash_key
from load_tests import tenant_flood
from load_tests.overlay import llm_lanes_application

KEYS = {"a": "sk-a", "b": "sk-b", "admin": "sk-admin"}


def test_the_served_config_has_the_runs_keys_hashed_and_the_overlay_merged(tmp_path):
    document, model = tenant_flood.served_config("load_tests/configs/tenant-flood.yaml", KEYS, tmp_path)
    args = llm_lanes_application(document)["args"]
    assert model == "tiny-llama"
    assert args["router"]["num_replicas"] == 2 and args["hot_lane"]["engine"]["max_num_seqs"] == 12
    keys = {key["tenant"]: key for key in args["auth"]["keys"]}
    assert args["auth"]["mode"] == "keys" and keys["team-a"]["sha256"] == hash_key("sk-a")
    assert keys["ops"]["admin"] is True and "sk-b" not in yaml.safe_dump(document)
    assert args["batch"]["store"] == str((tmp_path / "batches.sqlite3").resolve())


def test_the_report_gives_each_phase_and_the_flood_against_a_inside_its_share():
    phases = {phase: {"count": 24, "p50_ms": p50, "p90_ms": p50 * 2, "per_turn_p50_ms": [p50, p50]}
              for phase, p50 in (("alone", 50.0), ("in_share", 60.0), ("flood", 66.0))}
    report = {"flood_concurrency": 12, "in_share_concurrency": 6, "max_tokens": 256, "turns": 2,
              "samples_per_turn": 12, "autogroup": False, "phases": phases,
              "ratios": {"flood_vs_in_share_p50": 1.1, "flood_vs_alone_p50": 1.32},
              "b_lanes": {"flood hot:": 24}, "a_answers": {}}
    text = tenant_flood.render_markdown(report)
    assert "| flood | 24 | 66.0 | 132.0 | 66.0, 66.0 |" in text and "**1.1×**" in text
    assert "autogroup scheduling: off" in text


def test_url_mode_needs_the_three_keys(monkeypatch, tmp_path, capsys):
    for name in tenant_flood.KEY_ENV.values():
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        tenant_flood.main(["--url", "http://127.0.0.1:1", "--out", str(tmp_path)])
    assert "TENANT_FLOOD_KEY_A" in capsys.readouterr().err

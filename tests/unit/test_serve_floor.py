"""The Serve-floor benchmark's parts that need no Ray: the stand-ins' serve config and the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from load_tests.overlay import load_serve_config
from load_tests.serve_floor import APP_NAME, floor_config, render_markdown

REPO = Path(__file__).resolve().parents[2]


def test_the_stand_ins_take_the_base_configs_front_door_and_serve_settings_only():
    base = load_serve_config(str(REPO / "serve_configs" / "baseline-gpu.yaml"))
    config = floor_config(base, "handle")
    assert config["http_options"] == base["http_options"]
    assert config["proxy_location"] == base["proxy_location"]
    (application,) = config["applications"]
    assert application["name"] == APP_NAME
    assert application["import_path"] == "load_tests.serve_floor:build_floor_app"
    assert application["args"] == {"variant": "handle"}
    # Handle calls over gRPC and user code on the replica's main loop, as in the app the floor is compared with.
    assert application["runtime_env"] == base["applications"][0]["runtime_env"]
    assert "grpc_options" not in config


def test_an_unknown_stand_in_is_refused_by_name():
    base = load_serve_config(str(REPO / "serve_configs" / "local.yaml"))
    with pytest.raises(ValueError, match="unknown variant 'bare'"):
        floor_config(base, "bare")


def test_the_report_has_a_row_per_level_and_names_a_failed_stand_in():
    level = {"concurrency": 64, "clients": 8, "requests": 4000, "ok": 4000, "errors": {}, "requests_per_s": 1344.6,
             "e2e_ms": {"p50": 44.7, "p99": 75.6}, "client_cpu_per_wall_s": 0.23}
    report = {"front_door": "HAProxy", "base_config": "serve_configs/baseline-gpu.yaml", "started_at": "now",
              "variants": [{"variant": "handle", "error": None, "rate_ceiling": {"levels": [level]}},
                           {"variant": "ingress", "error": "did not start", "rate_ceiling": None}]}
    text = render_markdown(report)
    assert "| `handle` | 64 | 8 | 4000 (4000) | 1,344.6 | 44.7 / 75.6 | 0.23 | none |" in text
    assert "| `ingress` | failed: did not start |" in text
    assert "through HAProxy" in text

"""Operator tools against the real app: kv_budget agrees with the engine's KV capacity, doctor reads the app."""

from __future__ import annotations

import json
import subprocess
import sys

from app.tools.kv_budget import ModelShape, kv_bytes_per_token, tokens_fitting
from tests.integration.conftest import ROOT, lane_stats


def test_kv_budget_matches_the_cpu_engines_reported_capacity(app_url, tiny_model):
    import yaml

    args = yaml.safe_load((ROOT / "serve_configs" / "local.yaml").read_text())["applications"][0]["args"]
    shape = ModelShape.from_config(json.loads((tiny_model / "config.json").read_text()))
    per_token = kv_bytes_per_token(shape, kv_dtype_bytes=4)  # float32 on CPU
    for lane in ("hot", "cold"):
        engine = args[f"{lane}_lane"]["engine"]
        predicted = tokens_fitting(engine["kv_cache_memory_bytes"], per_token, engine["block_size"])
        reported = lane_stats(app_url)[lane]["kv_capacity_tokens"]
        assert abs(reported - predicted) <= 0.05 * predicted, (lane, reported, predicted)


def test_doctor_reads_the_running_app(app_url):
    result = subprocess.run([sys.executable, "-m", "app.tools.doctor", "--url", app_url, "--metrics-url", "",
                             "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode in (0, 1), result.stderr
    findings = json.loads(result.stdout)
    assert findings, "the doctor prints its findings"

"""Experiment overlays (load_tests/configs) merge onto a shipped config into a config the app's schema accepts, and
the merge itself: deep merge, lists replaced whole, `unset`, `--set dotted.key=value`."""

from pathlib import Path

import pytest
import yaml

from app.config import load_app_config
from load_tests.overlay import (
    ConfigRef,
    OverlayError,
    add_serve_config_arguments,
    deep_merge,
    llm_lanes_application,
    load_serve_config,
    main,
    parse_set,
)

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = sorted((REPO / "load_tests" / "configs").glob("*.yaml"))
SHIPPED = {"local.yaml", "baseline-local.yaml", "gpu-single.yaml", "baseline-gpu.yaml", "prod.yaml"}


def test_serve_configs_hold_only_the_shipped_configs():
    assert {p.name for p in (REPO / "serve_configs").glob("*.yaml")} == SHIPPED


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.name)
def test_every_overlay_merges_into_a_valid_config(path):
    overlay = yaml.safe_load(path.read_text())
    assert "base" in overlay and "applications" not in overlay
    base = (REPO / overlay["base"]).resolve()
    assert base.parent == REPO / "serve_configs" and base.name in SHIPPED
    document = load_serve_config(path)
    cfg = load_app_config(llm_lanes_application(document)["args"])
    assert cfg.model.served_name
    assert document != yaml.safe_load(base.read_text())  # an overlay that changes nothing is a copy


# The sweeps the overlays' comments name, as they would be run.
@pytest.mark.parametrize("overlay, sets", [
    ("gpu-lanes-mps.yaml", ["args.cold_lane.deployment.env_vars.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75",
                            "args.cold_lane.deployment.env_vars.CUDA_MPS_CLIENT_PRIORITY=0",
                            "args.cold_lane.engine.max_num_batched_tokens=2048",
                            "args.admission.interactive_decode_handoff_tokens=1"]),
    ("gpu-lanes-tuned.yaml", ["args.cold_lane.engine.max_num_batched_tokens=4096", "args.router.num_replicas=4"]),
    ("gpu-single-one-hot.yaml", ["args.hot_lane.engine.cuda_graph_max_tokens=null", "runtime_env.env_vars={}"]),
    ("prefix-2x.yaml", ["args.prefix_cache.routing=pow2"]),
    ("prefix-2x.yaml", ["args.prefix_cache.lookup=remote"]),
    ("gpu-prefix-2x.yaml", ["args.prefix_cache.routing=pow2"]),
])
def test_the_documented_sweeps_validate(overlay, sets):
    document = load_serve_config(REPO / "load_tests" / "configs" / overlay, sets)
    load_app_config(llm_lanes_application(document)["args"])


def test_an_environment_variable_stays_a_string():
    document = load_serve_config(REPO / "load_tests" / "configs" / "gpu-lanes-mps.yaml",
                                 ["args.cold_lane.deployment.env_vars.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75"])
    env = llm_lanes_application(document)["args"]["cold_lane"]["deployment"]["env_vars"]
    assert env == {"CUDA_MPS_CLIENT_PRIORITY": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75"}


# ---- the merge ---------------------------------------------------------------------------------------------------


def test_deep_merge_merges_mappings_and_replaces_lists_and_scalars():
    base = {"a": {"b": 1, "c": [1, 2, 3], "d": {"e": "x"}}, "f": None, "g": 1}
    merged = deep_merge(base, {"a": {"b": 2, "c": [9], "d": {"z": 0}}, "f": {"h": 1}, "g": None})
    assert merged == {"a": {"b": 2, "c": [9], "d": {"e": "x", "z": 0}}, "f": {"h": 1}, "g": None}
    assert base == {"a": {"b": 1, "c": [1, 2, 3], "d": {"e": "x"}}, "f": None, "g": 1}  # unchanged
    merged["a"]["d"]["e"] = "changed"
    assert base["a"]["d"]["e"] == "x"  # no shared nested objects


def _write(path: Path, document) -> Path:
    path.write_text(yaml.safe_dump(document))
    return path


BASE = {
    "http_options": {"host": "127.0.0.1", "port": 8000},
    "grpc_options": {"grpc_servicer_functions": ["a", "b"]},
    "applications": [
        {"name": "other", "import_path": "other:app", "args": {"x": 1}},
        {"name": "llm-lanes", "import_path": "app.main:build_app", "runtime_env": {"env_vars": {"A": "1"}},
         "args": {"hot_lane": {"engine": {"max_num_seqs": 32, "block_size": 32}}, "admission": {"x": 1, "y": 2},
                  "tags": [1, 2]}},
    ],
}


def test_an_overlay_changes_the_llm_lanes_application_and_the_top_level(tmp_path):
    base = _write(tmp_path / "base.yaml", BASE)
    overlay = _write(tmp_path / "exp.yaml", {
        "base": str(base), "unset": ["args.admission.y", "runtime_env"],
        "args": {"hot_lane": {"engine": {"max_num_seqs": 8}}, "tags": [3]},
        "http_options": {"port": 8001}, "grpc_options": {"grpc_servicer_functions": ["a"]}})
    document = load_serve_config(overlay)
    app = llm_lanes_application(document)
    assert app["args"] == {"hot_lane": {"engine": {"max_num_seqs": 8, "block_size": 32}}, "admission": {"x": 1},
                           "tags": [3]}
    assert "runtime_env" not in app and document["applications"][0] == BASE["applications"][0]
    assert document["http_options"] == {"host": "127.0.0.1", "port": 8001}
    assert document["grpc_options"]["grpc_servicer_functions"] == ["a"]  # a list is replaced whole


def test_an_overlay_may_build_on_an_overlay_and_names_a_missing_unset_key(tmp_path):
    base = _write(tmp_path / "base.yaml", BASE)
    first = _write(tmp_path / "first.yaml", {"base": str(base), "args": {"admission": {"x": 5}}})
    second = _write(tmp_path / "second.yaml", {"base": "first.yaml", "args": {"admission": {"z": 0}}})
    assert llm_lanes_application(load_serve_config(second))["args"]["admission"] == {"x": 5, "y": 2, "z": 0}
    broken = _write(tmp_path / "broken.yaml", {"base": str(base), "unset": ["args.admission.nope"]})
    with pytest.raises(OverlayError, match="args.admission.nope"):
        load_serve_config(broken)
    with pytest.raises(OverlayError, match="not found"):
        load_serve_config(_write(tmp_path / "lost.yaml", {"base": "no/such.yaml"}))


def test_set_parses_dotted_keys_and_yaml_values():
    assert parse_set("args.router.num_replicas=4")[:2] == ("args.router.num_replicas", 4)
    assert parse_set("args.x=null")[:2] == ("args.x", None)
    assert parse_set("args.x=[1, 2]")[:2] == ("args.x", [1, 2])
    assert parse_set("args.x={}")[:2] == ("args.x", {})
    assert parse_set("args.x=a=b")[:2] == ("args.x", "a=b")  # the first '=' splits


def test_set_changes_one_value_and_creates_missing_mappings(tmp_path):
    base = _write(tmp_path / "base.yaml", BASE)
    document = load_serve_config(base, ["args.hot_lane.engine.max_num_seqs=64", "args.batch.window_max=8",
                                        "runtime_env.env_vars.A=2", "http_options.port=9000"])
    app = llm_lanes_application(document)
    assert app["args"]["hot_lane"]["engine"] == {"max_num_seqs": 64, "block_size": 32}
    assert app["args"]["batch"] == {"window_max": 8}
    assert app["runtime_env"]["env_vars"]["A"] == "2"  # the base's string stays a string
    assert document["http_options"]["port"] == 9000


@pytest.mark.parametrize("text, names", [
    ("args.router.num_replicas", "expected KEY=VALUE"),
    ("=3", "dotted names"),
    ("args..x=3", "args..x"),
    ("args.x=[1, 2", "args.x"),
    ("args.hot_lane.engine.max_num_seqs.limit=3", "args.hot_lane.engine.max_num_seqs is 32"),
    ("args.tags.first=3", "args.tags is [1, 2]"),
])
def test_a_bad_set_is_refused_naming_the_key(tmp_path, text, names):
    base = _write(tmp_path / "base.yaml", BASE)
    with pytest.raises(OverlayError) as caught:
        load_serve_config(base, [text])
    assert names in str(caught.value)


def test_the_cli_writes_the_merged_config_and_reports_a_bad_set(tmp_path, capsys):
    base = _write(tmp_path / "base.yaml", BASE)
    overlay = _write(tmp_path / "exp.yaml", {"base": str(base), "args": {"admission": {"x": 7}}})
    out = tmp_path / "merged.yaml"
    assert main([str(overlay), "--set", "args.admission.y=3", "--out", str(out)]) == 0
    assert llm_lanes_application(yaml.safe_load(out.read_text()))["args"]["admission"] == {"x": 7, "y": 3}
    assert main([str(overlay), "--set", "args.admission.y", "--out", str(out)]) == 2
    assert "--set 'args.admission.y': expected KEY=VALUE" in capsys.readouterr().err
    assert main(["--label", str(overlay), "--set", "args.admission.y=3"]) == 0
    assert capsys.readouterr().out.strip() == "exp-y3"


def test_a_plain_config_is_served_from_its_own_path_and_an_overlay_from_its_merged_copy(tmp_path):
    base = _write(tmp_path / "base.yaml", BASE)
    overlay = _write(tmp_path / "exp.yaml", {"base": str(base), "args": {"admission": {"x": 7}}})
    assert ConfigRef(str(base)).servable_path(tmp_path / "out") == str(base)
    served = Path(ConfigRef(str(overlay)).servable_path(tmp_path / "out"))
    assert served == tmp_path / "out" / "serve-config-exp.yaml"
    assert yaml.safe_load(served.read_text()) == load_serve_config(overlay)
    with_set = ConfigRef(str(base), ("args.admission.x=9",))
    assert with_set.label == "base-x9"
    assert llm_lanes_application(yaml.safe_load(Path(with_set.servable_path(tmp_path)).read_text()))["args"][
        "admission"]["x"] == 9


def test_each_set_changes_the_serve_config_before_it():
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_config_arguments(parser, "config")
    args = parser.parse_args(["--serve-config", "a.yaml", "--serve-config", "a.yaml", "--set", "args.x=1",
                              "--set", "args.y=2", "--serve-config", "b.yaml"])
    assert args.serve_config == [ConfigRef("a.yaml"), ConfigRef("a.yaml", ("args.x=1", "args.y=2")),
                                 ConfigRef("b.yaml")]
    with pytest.raises(SystemExit):
        parser.parse_args(["--set", "args.x=1", "--serve-config", "a.yaml"])

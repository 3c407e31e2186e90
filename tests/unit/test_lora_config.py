"""LoRA settings in the schema: what each rule refuses, named with its fix, and what reaches vLLM's engine."""

import pytest

from app.config import AppConfig
from app.lanes.engine import engine_args_dict
from tests.unit.test_config import cpu_args

LORA = {"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4}
ADAPTERS = [{"name": "sql-expert", "path": "models/tiny-lora-a"}, {"name": "acme/support:v2", "path": "/x"}]


def lora_args(**overrides):
    return cpu_args(**{"hot_lane.engine.lora": LORA, "cold_lane.engine.lora": LORA, "model.adapters": ADAPTERS,
                       **overrides})


def test_lora_settings_reach_the_engine_arguments():
    cfg = AppConfig.model_validate(lora_args())
    args = engine_args_dict(cfg, cfg.cold_lane.engine)
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"], args["max_cpu_loras"]) == (True, 2, 8, 4)
    assert cfg.serves_lora
    assert [a.name for a in cfg.model.adapters] == ["sql-expert", "acme/support:v2"]


def test_without_lora_the_engine_arguments_have_none():
    cfg = AppConfig.model_validate(cpu_args())
    assert not {"enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"} & set(
        engine_args_dict(cfg, cfg.hot_lane.engine))
    assert not cfg.serves_lora


def test_adapters_need_lora_on_every_lane():
    with pytest.raises(ValueError, match=r"cold_lane.engine.lora is not set: add cold_lane.engine.lora"):
        AppConfig.model_validate(lora_args(**{"cold_lane.engine.lora": None}))


def test_one_lane_app_needs_lora_on_its_lane_only():
    args = lora_args()
    args["cold_lane"] = None
    assert AppConfig.model_validate(args).serves_lora


@pytest.mark.parametrize("lora, message", [
    ({"max_lora_rank": 12}, r"max_lora_rank=12 is not one vLLM supports: use one of \[1, 8, 16"),
    ({"max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras=2 < max_loras=4: .* raise max_cpu_loras"),
    ({"max_loras": 0}, r"max_loras"),
])
def test_lora_settings_refused_name_the_fix(lora, message):
    with pytest.raises(ValueError, match=message):
        AppConfig.model_validate(lora_args(**{"hot_lane.engine.lora": lora}))


def test_lora_engine_arguments_through_extra_engine_args_are_refused():
    with pytest.raises(ValueError, match=r"extra_engine_args sets \['enable_lora'\]: set the lane's engine.lora"):
        AppConfig.model_validate(cpu_args(**{"hot_lane.engine.extra_engine_args": {"enable_lora": True}}))


@pytest.mark.parametrize("adapters, message", [
    ([{"name": "a", "path": "x"}, {"name": "a", "path": "y"}], r"names \['a'\] more than once"),
    ([{"name": "tiny", "path": "x"}], r"'tiny' is the base model's served_name"),
    ([{"name": "bad name", "path": "x"}], r"name"),
    ([{"name": "a", "path": ""}], r"path"),
])
def test_adapter_lists_refused_name_the_fix(adapters, message):
    with pytest.raises(ValueError, match=message):
        AppConfig.model_validate(lora_args(**{"model.adapters": adapters}))

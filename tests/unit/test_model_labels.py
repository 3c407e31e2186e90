"""The per-model metrics' `model` label: the base model's served name or the adapter's, from a set bounded by
observability.model_label_limit (later adapters share `other`), as the rule hands it out and as the pipeline
records it for each request."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from app.config import ObservabilityConfig
from app.lanes.types import AdapterRef
from app.observability.model_labels import OTHER_MODELS, ModelLabels
from app.router.endpoints import COMPLETION
from tests.fakes import generation, make_pipeline


def test_the_first_adapters_up_to_the_limit_keep_their_names_and_later_ones_share_other():
    labels = ModelLabels("base", limit=2)
    assert [labels.label(name) for name in ("a", None, "b", "a", "c", "base", "d", "b")] == [
        "a", "base", "b", "a", OTHER_MODELS, "base", OTHER_MODELS, "b"]


def test_the_base_model_does_not_take_an_adapters_place():
    labels = ModelLabels("base", limit=1)
    for _ in range(3):
        assert labels.label(None) == labels.label("base") == "base"
    assert labels.label("a") == "a" and labels.label("b") == OTHER_MODELS


def test_the_configured_adapters_take_their_labels_first_so_every_replica_labels_them_alike():
    labels = ModelLabels("base", limit=2, configured=["static-a", "static-b"])
    assert labels.label("runtime") == OTHER_MODELS
    assert labels.label("static-b") == "static-b"


def test_the_limit_is_an_observability_setting_of_at_least_one():
    assert ObservabilityConfig().model_label_limit == 64
    assert ObservabilityConfig(model_label_limit=1).model_label_limit == 1
    with pytest.raises(ValidationError):
        ObservabilityConfig(model_label_limit=0)
    with pytest.raises(ValueError):
        ModelLabels("base", limit=0)


async def test_each_request_is_counted_under_the_name_it_was_served_under():
    pipeline, _, backend = make_pipeline(observability={"model_label_limit": 1})
    adapters = [AdapterRef("tiny-a", 1, "/adapters/tiny-a"), None, AdapterRef("tiny-b", 2, "/adapters/tiny-b")]
    for i, adapter in enumerate(adapters):
        prompt = replace(generation(prompt_tokens=5, stream=True, request_id=f"cmpl-{i}"), adapter=adapter)
        call = await pipeline.start(COMPLETION, prompt)
        [chunk async for chunk in call.chunks()]
    served = ["tiny-a", "tiny", OTHER_MODELS]
    assert backend.of("llm_lanes_model_requests_total") == [
        (1.0, {"model": model, "outcome": "success"}) for model in served]
    assert [tags["model"] for _, tags in backend.of("llm_lanes_model_ttft_seconds")] == served
    assert backend.of("llm_lanes_model_tokens_total") == [
        (value, {"model": model, "kind": kind}) for model in served for value, kind in ((5.0, "prompt"),
                                                                                         (6.0, "output"))]

"""vLLM's stream generators log what generate() raises; the pipeline's own refusals (429/503/504 answered to the
client with their OpenAI body) must not be logged as server errors with a traceback each."""

from __future__ import annotations

import logging

import pytest

from app.router import openai_api as api
from app.router.openai_surface import _STREAM_GENERATOR_LOGGERS, _quiet_pipeline_refusals


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.parametrize("name", _STREAM_GENERATOR_LOGGERS)
def test_refusals_are_dropped_and_other_errors_kept(name):
    _quiet_pipeline_refusals()
    _quiet_pipeline_refusals()  # idempotent: one filter per logger
    stream_logger = logging.getLogger(name)
    handler = Collect()
    stream_logger.addHandler(handler)
    try:
        for error in (api.OpenAIError(429, "the hot lane is full", code="hot_lane_full"), ValueError("engine bug")):
            try:
                raise error
            except Exception:
                stream_logger.exception("Error in chat completion stream generator.")
    finally:
        stream_logger.removeHandler(handler)
    assert [type(r.exc_info[1]) for r in handler.records] == [ValueError]
    assert sum(1 for f in stream_logger.filters if type(f).__name__ == "_PipelineRefusalFilter") == 1

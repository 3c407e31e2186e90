"""load_tests.surface_check on the installed vLLM: every differential request rendered and answered by vLLM's
serving code over fake engine outputs (the same check finds API differences with the GPU payload's vLLM 0.26)."""

from __future__ import annotations

import asyncio

from load_tests.surface_check import _surface, check, engine_refusal_problems, rendered_requests


def test_every_request_without_logprobs_is_answered_streamed_and_not_and_bad_ones_are_refused():
    answered, problems = asyncio.run(check(_surface()))
    assert problems == []
    assert answered == 2 * len(rendered_requests()) >= 80


def test_the_engines_refusals_are_the_clients_errors():
    assert engine_refusal_problems() == []

"""The app against vLLM's own OpenAI server: the same tiny model and hot-lane engine arguments, the same requests to
both, one at a time, and the same answers.

The requests, what is compared and the documented differences are in load_tests/openai_differential.py, which runs
the same comparison against any serve config (the GPU payload's vLLM included); here vLLM's server runs beside the
shared test app, with the hot lane's engine arguments from local.yaml and the model settings the app has (hermes
tool-call parser, auto tool choice).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from load_tests.openai_differential import (compare_answers, compare_placed, compare_refusals, compare_unrecognized,
                                            vllm_server_command)
from load_tests.serve_runner import ServedApp
from tests.integration.conftest import local_test_document

START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_own_server(document: dict, log_path: Path) -> Iterator[str]:
    """vLLM's own OpenAI server for a serve config's document (its hot lane's engine arguments, its model
    settings), running while the generator is: yields its URL."""
    port = free_port()
    command, env = vllm_server_command(document, port)
    server = ServedApp(f"http://127.0.0.1:{port}", log_path, start_command=command, ready_timeout_s=START_TIMEOUT_S,
                       ready_path="/health", lanes_path=None, env=env)
    server.start()
    try:
        server.wait_ready()
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vllm_server(tiny_model, tmp_path_factory, app_url):
    """vLLM's own OpenAI server on the hot lane's engine arguments (started after the app: they share the cores)."""
    document, _ = local_test_document(tiny_model)
    yield from vllm_own_server(document, Path(tmp_path_factory.mktemp("vllm_server")) / "vllm.log")


def test_the_app_answers_as_vllms_own_server(app_url, vllm_server, served_model):
    compared, problems = compare_answers(app_url, vllm_server, served_model)
    assert not problems, "\n".join(problems)
    assert compared >= 60


def test_what_vllms_server_refuses_the_app_refuses_alike(app_url, vllm_server, served_model):
    problems = compare_refusals(app_url, vllm_server, served_model)
    assert not problems, "\n".join(problems)


def test_a_field_vllms_server_ignores_the_app_refuses_naming_it(app_url, vllm_server, served_model):
    problems = compare_unrecognized(app_url, vllm_server, served_model)
    assert not problems, "\n".join(problems)


def test_a_malformed_message_is_refused_naming_its_place_where_vllms_server_names_none(app_url, vllm_server,
                                                                                       served_model):
    problems = compare_placed(app_url, vllm_server, served_model)
    assert not problems, "\n".join(problems)

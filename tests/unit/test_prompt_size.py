"""prompt_size(): what decides whether the Router tokenizes a request inline or on its worker thread."""

from app.router import openai_api as api
from app.router.pipeline import TOKENIZE_INLINE_MAX_CHARS


def chat(*contents):
    return api.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]})


def test_chat_counts_every_message_and_content_parts():
    assert chat("abc", "de").prompt_size() == 5
    parts = [{"type": "text", "text": "x" * 100}]
    assert chat(parts).prompt_size() >= 100
    assert chat(None).prompt_size() == 0


def test_completion_counts_text_and_token_ids():
    assert api.CompletionRequest.model_validate({"model": "m", "prompt": "hello"}).prompt_size() == 5
    assert api.CompletionRequest.model_validate({"model": "m", "prompt": ["ab", "c"]}).prompt_size() == 3
    assert api.CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3]}).prompt_size() == 12


def test_a_batch_sized_prompt_goes_to_the_thread_and_a_chat_turn_stays_inline():
    # ~2,048 tokens of English is ~8,000 characters; a 256-token chat turn ~1,000.
    assert chat("word " * 1600).prompt_size() > TOKENIZE_INLINE_MAX_CHARS
    assert chat("word " * 200).prompt_size() <= TOKENIZE_INLINE_MAX_CHARS

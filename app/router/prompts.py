"""Prompts to token ids, once, with the model's own tokenizer (chat template applied here). No Ray."""

from __future__ import annotations

from typing import Any

from app.router import openai_api as api


class PromptTokenizer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def token_ids(self, body) -> list[int]:
        """The prompt of a chat or completion request as token ids. Raises OpenAIError naming the parameter."""
        if isinstance(body, api.ChatCompletionRequest):
            return self.chat_token_ids(body)
        return self.prompt_token_ids(body.prompt)

    def chat_token_ids(self, body: api.ChatCompletionRequest) -> list[int]:
        if not body.messages:
            raise api.OpenAIError(400, "messages must hold at least one message", param="messages",
                                  code="empty_prompt")
        try:
            conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as error:
            raise api.OpenAIError(400, str(error), param="messages") from None
        if not any(m["content"].strip() for m in conversation):
            raise api.OpenAIError(400, "every message is empty: send some content", param="messages",
                                  code="empty_prompt")
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_token_ids(self, prompt: str | list) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise api.OpenAIError(400, "send one prompt per request (a list of several is not supported)",
                                      param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise api.OpenAIError(400, "prompt is empty", param="prompt", code="empty_prompt")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            token_ids = list(prompt)
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in token_ids):
                raise api.OpenAIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not token_ids:
            raise api.OpenAIError(400, "prompt is empty", param="prompt", code="empty_prompt")
        return token_ids

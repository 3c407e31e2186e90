"""What a lane can take: its context length and its max_tokens cap. Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaneCaps:
    max_model_len: int
    # Largest max_tokens the lane accepts; a larger request is clipped to it. None: only max_model_len limits it.
    max_tokens_cap: int | None = None

    def clipped_max_tokens(self, max_tokens: int) -> int:
        return max_tokens if self.max_tokens_cap is None else min(max_tokens, self.max_tokens_cap)

    def fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        return prompt_tokens + self.clipped_max_tokens(max_tokens) <= self.max_model_len

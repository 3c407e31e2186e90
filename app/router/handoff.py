"""Decode handoff: an interactive request's first tokens on the hot lane, the rest of its answer on the cold lane.

Why: on one GPU the hot lane's decode steps are what the lanes cost the batch work. Each hot step reads all the
weights for the few interactive sequences it carries, on the GPU the cold lane needs (measured on the H200: the
split alone costs nothing; serving interactive decode on the hot lane costs ~12 % of the batch; docs/history.md). In
the cold lane's large batch steps a few more sequences cost almost nothing. So the hot lane keeps what users feel
first, the time to the first token, and the cold lane decodes the rest at interactive priority, ahead of every batch
request.
The price is the interactive request's time per output token: the cold lane's step time instead of the hot lane's.

The cold lane gets no KV from the hot lane: it recomputes the prompt plus the tokens already sent (a short prefill
next to the batch's). The continuation is the prompt's token ids followed by the generated ones, so nothing is
re-tokenized and the answer goes on exactly where the hot lane stopped.

Off by default (`admission.interactive_decode_handoff_tokens: 0`). A pure decision, one input of the routing
decision (app/router/spill.py), and which sampling parameters a continuation cannot carry (`handoff_blocker`, read
from vLLM's SamplingParams by attribute); no Ray, no vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping

from app.classes import Lane, RequestClass
from app.router.lane_caps import LaneCaps

REASON_DECODE_ON_COLD = "decode_on_cold"


def handoff_after_tokens(*, request_class: RequestClass, lane: Lane, prompt_tokens: int, max_tokens: int,
                         has_stop_strings: bool, handoff_tokens: int, lane_caps: Mapping[Lane, LaneCaps]) -> int | None:
    """Tokens the hot lane generates before the cold lane continues the answer, or None: the hot lane serves it all.

    Only an interactive request routed to the hot lane is handed off (realtime keeps the hot lane's step time; a
    request already on the cold lane has nothing to hand off), and only when:
    - the answer can be longer than the hot lane's part (max_tokens > handoff_tokens);
    - it has no stop strings: one could straddle the boundary, and the cold engine never sees the text before it;
    - the cold lane can take the whole request (its max_model_len and max_tokens cap).
    """
    if handoff_tokens <= 0 or request_class is not RequestClass.INTERACTIVE or lane is not Lane.HOT:
        return None
    cold = lane_caps.get(Lane.COLD)
    if cold is None or max_tokens <= handoff_tokens or has_stop_strings:
        return None
    if not cold.fits(prompt_tokens, max_tokens) or cold.clipped_max_tokens(max_tokens) < max_tokens:
        return None
    return handoff_tokens


def handoff_blocker(params) -> str | None:
    """Why a decode handoff's continuation (a new engine request whose prompt holds the tokens so far) would not
    answer as one engine request does; None if it would."""
    if params.n != 1:
        return "n"
    if params.logprobs is not None or params.prompt_logprobs is not None:
        return "logprobs"
    if getattr(params, "structured_outputs", None) is not None or getattr(params, "guided_decoding", None) is not None:
        return "structured_output"
    if params.seed is not None:
        return "seed"
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        return "penalties"
    if params.logit_bias or getattr(params, "allowed_token_ids", None) or params.min_tokens:
        return "logit_bias"
    if params.stop or params.stop_token_ids:
        return "stop"
    return None

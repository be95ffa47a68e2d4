"""What the engine says about a request after an iteration: new tokens, and at the end why it finished."""

from __future__ import annotations

from enum import IntEnum

import msgspec


class FinishReason(IntEnum):
    """Why a request ended; `label` is the OpenAI / vLLM spelling used in JSON."""

    STOP = 0
    """EOS, a stop token id or a stop string."""
    LENGTH = 1
    """max_tokens reached, or the model's context is full."""
    ABORT = 2
    """The client or an operator aborted it."""
    ERROR = 3
    """The system could not serve it; an error message travels with it."""

    @property
    def label(self) -> str:
        return self.name.lower()


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Log-probability of a sampled token, and the top alternatives as (token_id, logprob) pairs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class RequestOutput(msgspec.Struct, frozen=True, gc=False):
    """New tokens of one request from one iteration; `finish_reason` is set on its last output."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    retry: bool = False
    """With an error: one that passes (no engine for a while, the queue full), so the request may be sent again."""
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """With the first token of a request that asked for them: one per prompt token after the first."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

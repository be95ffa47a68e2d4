"""Per-request sampling parameters, shared by the CLI, the services and the engine.

A frozen msgspec Struct so it travels on NATS unchanged; `validate()` turns bad user
values into a `ValueError` that names the field (never an assert).
"""

from __future__ import annotations

import math

import msgspec

from shared.structured import StructuredOutputs

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
"""Most entries in one request's logit_bias."""


class SamplingKnobs(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling fields a request body (`shared.api.GenerateRequest`) and the engine's SamplingParams
    share, declared once; each adds the fields it spells its own way (stop strings, constraints)."""

    max_tokens: int | None = 16
    """Upper bound on generated tokens; None: until the context (or a smaller KV cache) is full (vLLM's offline
    meaning). Orca
    reserves prompt_len + max_tokens KV slots (within the context)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k (vLLM uses -1 for that; both are accepted)."""
    min_p: float = 0.0
    seed: int | None = None
    """A per-request seed makes sampling reproducible whatever else is in the batch."""
    ignore_eos: bool = False
    min_tokens: int = 0
    """vLLM's: until this many tokens are out, EOS and the stop token ids cannot be sampled and stop strings
    do not match."""
    skip_special_tokens: bool = True
    """vLLM's: special tokens are left out of the text (their ids stay in the output)."""
    include_stop_str_in_output: bool = False
    """vLLM's: the text keeps the stop string (or the stop token's text) that ended it."""
    logprobs: int | None = None
    """Return the log-probability of each sampled token and of the top-k alternatives."""
    prompt_logprobs: int | None = None
    """vLLM's: the log-probability of each prompt token after the first (given the tokens before it) and of
    the top-k alternatives there, as of the raw distribution. Such a prompt is always computed whole (no
    cached prefix)."""
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    """OpenAI's: token id -> a bias in [-100, 100] added to its logit before the penalties and sampling
    (-100 all but bans the token, 100 all but forces it). Logprobs stay those of the raw distribution."""
    allowed_token_ids: tuple[int, ...] | None = None
    """vLLM's: only these tokens can be sampled (logprobs stay those of the raw distribution)."""

    def output_limit(self, prompt_len: int, max_model_len: int) -> int:
        """Most tokens a request with a prompt this long may generate: max_tokens, within the context."""
        room = max_model_len - prompt_len
        return room if self.max_tokens is None else min(self.max_tokens, room)

    def knobs(self) -> dict:
        """These fields by name (to build a SamplingParams from a request body)."""
        return {name: getattr(self, name) for name in SamplingKnobs.__struct_fields__}


class SamplingParams(SamplingKnobs, frozen=True, forbid_unknown_fields=True):
    stop: tuple[str, ...] = ()
    """Stop strings, matched on the detokenized text; the match is not returned."""
    stop_token_ids: tuple[int, ...] = ()
    structured_outputs: StructuredOutputs | None = None
    """What the output must match (a JSON schema, a regex, ...): the engine masks every other token."""

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether its logits change before sampling (a bias or a penalty): the sampler's per-row path."""
        return (
            bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or self.min_tokens > 0
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise ValueError if a token id it names is outside the vocabulary (the sampler would index past it)."""
        for field, ids in (("logit_bias", self.logit_bias or ()), ("stop_token_ids", self.stop_token_ids),
                           ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(f"{field} token id {bad} is outside the vocabulary [0, {vocab_size})")

    def validate(self) -> SamplingParams:
        """Return self (with top_k=-1 normalised to 0) or raise ValueError naming the field."""
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "must be an integer >= 1 (or null: until the context is full)")
        _check(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool) and self.min_tokens >= 0,
               "min_tokens", self.min_tokens, "must be an integer >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"exceeds max_tokens ({self.max_tokens}, its default where not given)")
        _check(not (self.min_tokens and self.structured_outputs is not None), "min_tokens", self.min_tokens,
               "cannot be combined with structured outputs (a complete output could then end nowhere)")
        _check(_finite(self.temperature) and self.temperature >= 0.0,
               "temperature", self.temperature, "must be a finite number >= 0")
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= -1,
               "top_k", self.top_k, "must be -1, 0 (disabled) or a positive integer")
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               "seed", self.seed, "must be an integer in [0, 2**63)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and not isinstance(value, bool)
                                     and 0 <= value <= MAX_TOP_LOGPROBS),
                   name, value, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0.0,
               "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(_finite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
               "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check(_finite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
               "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        _check_logit_bias(self.logit_bias or {})
        _check(self.allowed_token_ids is None or (
            len(self.allowed_token_ids) > 0 and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in self.allowed_token_ids)),
               "allowed_token_ids", self.allowed_token_ids, "must be a non-empty list of token ids")
        params = self
        if self.top_k == -1:
            params = msgspec.structs.replace(params, top_k=0)
        if self.structured_outputs is not None:
            params = msgspec.structs.replace(params, structured_outputs=self.structured_outputs.validate())
        return params


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_logit_bias(bias: dict[int, float]) -> None:
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    for token, value in bias.items():
        _check(isinstance(token, int) and token >= 0, "logit_bias token id", token, "must be an integer >= 0")
        _check(_finite(value) and -100.0 <= value <= 100.0, f"logit_bias[{token}]", value, "must be in [-100, 100]")


def _check(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r} {rule}")

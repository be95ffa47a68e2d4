"""Turn the logits of one iteration into one token per request.

Order, as in vLLM: penalties, then greedy argmax or temperature / top-k / top-p / min-p
and a draw. A request with a seed draws from its own generator, so its tokens do not
depend on what else is in the batch. Logprobs are of the model's raw distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.outputs import TokenLogprob
from shared.sampling import SamplingParams


@dataclass
class SamplingState:
    """What the sampler needs to remember about one request between iterations."""

    params: SamplingParams
    token_ids: list[int]  # prompt + generated so far (penalties look at them)
    num_prompt_tokens: int
    generator: torch.Generator | None  # only for requests with a seed


def sample(logits: torch.Tensor, states: list[SamplingState],
           default_generator: torch.Generator) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: (N, V), row i belongs to states[i]. Returns token ids and optional logprobs."""
    raw = logits
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.clone()
    for row, state in enumerate(states):
        if state.params.needs_penalties:
            _apply_penalties(logits[row], state)
    if all(s.params.is_greedy for s in states):
        tokens = logits.argmax(dim=-1).tolist()
    else:
        tokens = [_draw(logits[row], s, default_generator) for row, s in enumerate(states)]
    logprobs = _logprobs(raw, tokens, states)
    return tokens, logprobs


def _apply_penalties(row: torch.Tensor, state: SamplingState) -> None:
    params = state.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(state.token_ids)), dtype=torch.long, device=row.device)
        scores = row[seen]
        row[seen] = torch.where(scores < 0, scores * params.repetition_penalty, scores / params.repetition_penalty)
    generated = state.token_ids[state.num_prompt_tokens:]
    if generated and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(generated, dtype=torch.long, device=row.device)
        counts = torch.bincount(ids, minlength=row.shape[0]).to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def _draw(row: torch.Tensor, state: SamplingState, default_generator: torch.Generator) -> int:
    params = state.params
    if params.is_greedy:
        return int(row.argmax())
    row = row / params.temperature
    if 0 < params.top_k < row.shape[0]:
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        row = _top_p(row, params.top_p)
    probs = torch.softmax(row, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) draws from p exactly.
    generator = state.generator or default_generator
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def _top_p(row: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(row, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token that crosses top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(row).scatter_(0, order, sorted_logits)


def _logprobs(raw: torch.Tensor, tokens: list[int],
              states: list[SamplingState]) -> list[TokenLogprob | None]:
    wanted = [row for row, s in enumerate(states) if s.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(states)
    if not wanted:
        return out
    logp = torch.log_softmax(raw[wanted].double(), dim=-1)
    for i, row in enumerate(wanted):
        k = states[row].params.logprobs or 0
        top = torch.topk(logp[i], k) if k else None
        alternatives = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
        out[row] = TokenLogprob(tokens[row], float(logp[i, tokens[row]]), alternatives)
    return out

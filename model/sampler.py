"""Turn the logits of one iteration into one token per request.

Order, as in vLLM: logit bias, min_tokens' ban of the ending tokens, penalties, then greedy argmax or temperature / top-k / top-p / min-p
and a draw. A request with a seed draws from its own generator, so its tokens do not
depend on what else is in the batch. Logprobs are of the model's raw distribution.
"""

from __future__ import annotations

from collections.abc import Callable
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
    ends: tuple[int, ...] = ()
    """The tokens that would end it (EOS, its stop token ids): banned until `params.min_tokens` are out."""


def sample(logits: torch.Tensor, states: list[SamplingState],
           default_generator: torch.Generator) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: (N, V), row i belongs to states[i]. Returns token ids and optional logprobs.

    Batched: greedy rows take one argmax, unseeded random rows one batched draw; only rows with
    penalties or their own seed (whose draws must not depend on the batch) are handled one by one."""
    raw = logits
    penalised = [row for row, s in enumerate(states) if s.params.adjusts_logits]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    elif penalised:
        logits = logits.clone()  # penalties write into it; the raw logits feed the logprobs
    for row in penalised:
        _apply_penalties(logits[row], states[row])
    tokens = logits.argmax(dim=-1)  # (N,): the greedy rows' answer
    random_rows = [row for row, s in enumerate(states) if not s.params.is_greedy]
    if random_rows:
        tokens = tokens.clone()
        unseeded = [row for row in random_rows if states[row].generator is None]
        if unseeded:
            tokens[unseeded] = _draw_batch(logits[unseeded], [states[row].params for row in unseeded],
                                           default_generator)
        for row in random_rows:
            if states[row].generator is not None:
                tokens[row] = _draw(logits[row], states[row], default_generator)
    token_list = tokens.tolist()
    return token_list, _logprobs(raw, token_list, states)


def _draw_batch(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator) -> torch.Tensor:
    """One draw per row (n, V) with per-row temperature, top-k, top-p and min-p, in a fixed number of
    tensor ops whatever n is."""
    n, vocab = logits.shape
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temperature[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if min(top_k) < vocab or min(top_p) < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (n, V)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        keep_k = torch.tensor(top_k, device=logits.device)[:, None]
        sorted_logits = sorted_logits.masked_fill(rank >= keep_k, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token: keep the one crossing top_p
        limit = torch.tensor(top_p, dtype=probs.dtype, device=logits.device)[:, None]
        sorted_logits = sorted_logits.masked_fill(before > limit, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=logits.device)[:, None]
    probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    noise = torch.empty_like(probs).exponential_(generator=generator)  # Gumbel-max, as in _draw
    return (probs / noise).argmax(dim=-1)


def _apply_penalties(row: torch.Tensor, state: SamplingState) -> None:
    """The request's allowed tokens, its logit bias, then its penalties, into its row of logits."""
    params = state.params
    if params.allowed_token_ids is not None:
        ids = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=row.device)
        kept = row[ids]
        row.fill_(float("-inf"))
        row[ids] = kept
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=row.device)
        row.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=row.device))
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(state.token_ids)), dtype=torch.long, device=row.device)
        scores = row[seen]
        row[seen] = torch.where(scores < 0, scores * params.repetition_penalty, scores / params.repetition_penalty)
    generated = state.token_ids[state.num_prompt_tokens:]
    if len(generated) < params.min_tokens and state.ends:
        row[torch.tensor(state.ends, dtype=torch.long, device=row.device)] = float("-inf")
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


LOGPROB_FLOOR = -9999.0
"""The lowest log-probability reported (vLLM's)."""


def _logprobs(raw: torch.Tensor, tokens: list[int],
              states: list[SamplingState]) -> list[TokenLogprob | None]:
    wanted = [row for row, s in enumerate(states) if s.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(states)
    if not wanted:
        return out
    # A token a constraint masks has log-probability -inf, which JSON cannot carry (it came out as null):
    # it is LOGPROB_FLOOR instead, as vLLM's API gives it.
    logp = torch.log_softmax(raw[wanted].double(), dim=-1).clamp_(min=LOGPROB_FLOOR)
    for i, row in enumerate(wanted):
        k = states[row].params.logprobs or 0
        top = torch.topk(logp[i], k) if k else None
        alternatives = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
        out[row] = TokenLogprob(tokens[row], float(logp[i, tokens[row]]), alternatives)
    return out


PROMPT_LOGITS_ROWS = 256
"""Prompt positions turned into logits at once: a long prompt's (T, V) logits at once would take gigabytes."""


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: list[int], k: int) -> list[TokenLogprob]:
    """Row i of `hidden` (a prompt position) scored against prompt token targets[i], with the top k there,
    of the raw distribution (no penalty, bias or temperature), as the sampled tokens' logprobs are."""
    out: list[TokenLogprob] = []
    for at in range(0, len(targets), PROMPT_LOGITS_ROWS):
        logp = torch.log_softmax(compute_logits(hidden[at:at + PROMPT_LOGITS_ROWS]).double(), dim=-1)
        logp.clamp_(min=LOGPROB_FLOOR)
        chunk = targets[at:at + PROMPT_LOGITS_ROWS]
        picked = logp.gather(1, torch.tensor(chunk, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
        if k:
            top = torch.topk(logp, k, dim=-1)
            alternatives = [tuple(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
        else:
            alternatives = [()] * len(chunk)
        out += [TokenLogprob(t, lp, alt) for t, lp, alt in zip(chunk, picked, alternatives)]
    return out

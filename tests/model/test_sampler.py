"""Sampling: each parameter does what it says, seeds make draws independent of the batch."""

from __future__ import annotations

import math

import pytest
import torch

from model.sampler import SamplingState, sample
from shared.sampling import SamplingParams


def state(params: SamplingParams, tokens=(1, 2, 3), num_prompt=3, seed=None) -> SamplingState:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingState(params, list(tokens), num_prompt, gen)


def draw(logits_row, params, n=200, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.tensor([logits_row] * n, dtype=torch.float32)
    tokens, _ = sample(logits, [state(params) for _ in range(n)], gen)
    return tokens


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, 1.0, 0.0]])
    tokens, _ = sample(logits, [state(SamplingParams(temperature=0.0))] * 2, torch.Generator())
    assert tokens == [1, 0]


def test_top_k_keeps_only_the_k_best():
    assert set(draw([1.0, 0.9, 0.8, 0.7, -5.0], SamplingParams(temperature=1.0, top_k=2))) <= {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities ~ [0.64, 0.23, 0.09, 0.03]: top_p=0.7 keeps the first two
    tokens = draw([2.0, 1.0, 0.1, -1.0], SamplingParams(temperature=1.0, top_p=0.7))
    assert set(tokens) <= {0, 1} and len(set(tokens)) == 2


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    tokens = draw([2.0, 1.9, -3.0, -3.0], SamplingParams(temperature=1.0, min_p=0.2))
    assert set(tokens) <= {0, 1}


def test_temperature_sharpens():
    cold = draw([1.0, 0.5, 0.0], SamplingParams(temperature=0.05))
    hot = draw([1.0, 0.5, 0.0], SamplingParams(temperature=5.0))
    assert cold.count(0) > 190 and hot.count(0) < 150


def test_a_seeded_request_draws_the_same_tokens_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=42)
    logits = torch.randn(1, 50)
    alone, _ = sample(logits, [state(params, seed=42)], torch.Generator().manual_seed(1))
    crowd_logits = torch.cat([torch.randn(3, 50), logits])
    others = [state(SamplingParams(temperature=1.0)) for _ in range(3)]
    crowded, _ = sample(crowd_logits, others + [state(params, seed=42)], torch.Generator().manual_seed(2))
    assert crowded[3] == alone[0]


def test_repetition_penalty_as_transformers_applies_it():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    tokens, _ = sample(logits, [state(params, tokens=(0, 1), num_prompt=2)], torch.Generator())
    assert tokens == [2]  # 2.0/4 = 0.5 < 1.0


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.4, presence_penalty=0.0)
    # token 0 is in the prompt (no penalty) and generated twice (-0.8): 2.2 < 2.5
    tokens, _ = sample(logits, [state(params, tokens=(0, 0, 0), num_prompt=1)], torch.Generator())
    assert tokens == [1]
    tokens, _ = sample(logits, [state(params, tokens=(0, 2), num_prompt=2)], torch.Generator())
    assert tokens == [0]


def test_logit_bias_bans_and_forces_tokens_and_comes_before_the_penalties():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    states = [state(SamplingParams(temperature=0.0, logit_bias={0: -100.0})),  # banned: the next best wins
              state(SamplingParams(temperature=0.0, logit_bias={3: 100.0})),  # forced
              state(SamplingParams(temperature=0.0))]  # a row beside them is untouched
    tokens, logprobs = sample(logits, states, torch.Generator())
    assert tokens == [1, 3, 0]
    forced = draw([3.0, 2.0, 1.0, 0.0], SamplingParams(temperature=1.0, logit_bias={3: 100.0}), n=50)
    assert set(forced) == {3}
    # bias first, as vLLM: 1.0 + 2.0 = 3.0 is then divided by the repetition penalty (token 2 was seen)
    params = SamplingParams(temperature=0.0, logit_bias={2: 2.0}, repetition_penalty=2.0)
    tokens, _ = sample(torch.tensor([[2.0, 1.0, 1.0]]), [state(params, tokens=(2,), num_prompt=1)], torch.Generator())
    assert tokens == [0]  # 3.0 / 2 = 1.5 < 2.0
    tokens, logprobs = sample(torch.tensor([[1.0, 2.0]]), [state(SamplingParams(temperature=0.0, logprobs=1,
                                                                                logit_bias={0: 5.0}))],
                              torch.Generator())
    assert tokens == [0] and math.isclose(logprobs[0].logprob, math.log(1 / (1 + math.e)), rel_tol=1e-6), \
        "logprobs stay those of the raw distribution"


def test_allowed_token_ids_are_the_only_tokens_drawn_greedy_or_not_and_logprobs_stay_raw():
    """vLLM's allowed_token_ids, beside a row without them (batched draws and seeded ones alike)."""
    row = [3.0, 2.0, 1.0, 0.5, 0.0]
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=(2, 4), logprobs=0)
    tokens, logprobs = sample(torch.tensor([row] * 2), [state(allowed), state(SamplingParams(temperature=0.0))],
                              torch.Generator())
    assert tokens == [2, 0]
    assert math.isclose(logprobs[0].logprob, torch.log_softmax(torch.tensor(row).double(), -1)[2].item(), rel_tol=1e-9)
    assert set(draw(row, SamplingParams(temperature=1.0, allowed_token_ids=(1, 3)))) == {1, 3}
    seeded = [sample(torch.tensor([row]), [state(SamplingParams(temperature=1.0, allowed_token_ids=(0, 4)), seed=s)],
                     torch.Generator())[0][0] for s in range(40)]
    assert set(seeded) == {0, 4}
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=()).validate()
    with pytest.raises(ValueError, match=r"allowed_token_ids token id 9 is outside the vocabulary \[0, 5\)"):
        SamplingParams(allowed_token_ids=(1, 9)).check_vocabulary(5)


def test_a_logit_bias_past_the_vocabulary_is_refused_before_it_reaches_a_sampler():
    SamplingParams(logit_bias={99: 1.0}).check_vocabulary(100)
    with pytest.raises(ValueError, match=r"logit_bias token id 100 is outside the vocabulary \[0, 100\)"):
        SamplingParams(logit_bias={100: 1.0}).check_vocabulary(100)


def test_logprobs_are_of_the_raw_distribution_with_top_alternatives():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    _, logprobs = sample(logits, [state(SamplingParams(temperature=0.0, logprobs=2))], torch.Generator())
    expected = torch.log_softmax(logits.double(), -1)[0]
    assert logprobs[0].token_id == 2 and math.isclose(logprobs[0].logprob, expected[2].item(), rel_tol=1e-9)
    assert [t for t, _ in logprobs[0].top] == [2, 1]


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 1.5), ("seed", -1), ("stop", ("",)), ("stop_token_ids", (-1,)),
    ("logprobs", 21), ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("logit_bias", {1: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {1: float("inf")}),
    ("logit_bias", {i: 1.0 for i in range(1025)}),
])
def test_bad_values_raise_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def test_top_k_minus_one_means_disabled_as_in_vllm():
    assert SamplingParams(top_k=-1).validate().top_k == 0


def test_one_batch_of_mixed_parameters_applies_each_rows_own():
    """The batched draw: greedy, top-k, top-p, min-p and plain rows side by side, 100 draws each."""
    row = [2.0, 1.9, 1.0, 0.1, -1.0]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, min_p=0.5),
              SamplingParams(temperature=1.0)]
    seen: list[set[int]] = [set() for _ in params]
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        tokens, _ = sample(torch.tensor([row] * len(params)), [state(p) for p in params], gen)
        for i, t in enumerate(tokens):
            seen[i].add(t)
    assert seen[0] == {0}
    assert seen[1] == {0, 1}
    assert seen[2] <= {0, 1} and len(seen[2]) == 2  # probabilities ~[.39, .35, .14, ...]: two reach 0.5
    assert seen[3] == {0, 1}  # 0.5 x 0.39 drops everything below 0.195
    assert len(seen[4]) >= 4

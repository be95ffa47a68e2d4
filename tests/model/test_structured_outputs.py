"""Constrained decoding in the engine (model/structured.py), with the random-weight demo model, which
never writes JSON by chance: every constrained output matches its schema, regex, choice or grammar
under every scheduling policy, preemption by recompute, chunked prefill and async scheduling; the
unconstrained requests beside them produce, in float64, exactly the tokens they produce alone."""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest
import torch

from engine.llm_engine import LLMEngine
from model.structured import apply_token_bitmask
from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from shared.outputs import FinishReason
from shared.sampling import SamplingParams
from shared.structured import MAX_SCHEMA_DEPTH, TOO_DEEP, StructuredOutputs

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                     "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "role", "address"],
}
REGEX = r"[A-Z]{2}-[0-9]{3,5}"
CHOICES = ["red", "green", "blue, or \"other\""]
GRAMMAR = 'start: "(" expr ")"\nexpr: NUMBER ("+" NUMBER){0,3}\nNUMBER: /[0-9]{1,3}/'
SPECS = [StructuredOutputs(json=PERSON), StructuredOutputs(regex=REGEX), StructuredOutputs(choice=CHOICES),
         StructuredOutputs(grammar=GRAMMAR)]
"""Each bounded, so a random-weight model ends them (any JSON object need not end: its keys may run on)."""
PROMPTS = [[5 + 7 * i + j for j in range(3 + 9 * i)] for i in range(5)]


def make_engine(model: str, *, policy: str = "orca", kv_tokens: int = 8192, block_size: int = 16,
                chunked: bool = False, async_scheduling: bool = True, dtype: str = "float32") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=model, dtype=dtype),
        scheduler=SchedulerConfig(policy=policy, max_num_seqs=16, async_scheduling=async_scheduling,
                                  max_num_batched_tokens=16 if chunked else None, enable_chunked_prefill=chunked),
        cache=CacheConfig(kv_cache_tokens=kv_tokens, block_size=block_size)))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished:
        for delta in engine.step():
            if delta.finished:
                done[delta.completion.request_id] = delta.completion
    assert engine.kv_cache.num_used_blocks == 0
    return done


def check(spec: StructuredOutputs, text: str) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json if isinstance(spec.json, dict) else json.loads(spec.json))
    elif spec.json_object:
        assert isinstance(json.loads(text), dict)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    else:
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3}){0,3}\)", text), text


def constrained(n: int = 10) -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy and seeded random requests for every kind of constraint."""
    return {f"c{i}": (PROMPTS[i % len(PROMPTS)],
                      SamplingParams(max_tokens=110, temperature=0.0 if i % 2 else 1.0, seed=i,
                                     structured_outputs=SPECS[i % len(SPECS)]))
            for i in range(n)}


@pytest.mark.parametrize("policy,kv_tokens,block_size,chunked,async_scheduling", [
    ("orca", 8192, 16, False, True),
    ("orca", 8192, 16, False, False),
    ("orca", 8192, 16, True, True),
    ("paged", 200, 4, False, True),  # a cache this small preempts: matchers are rebuilt from the tokens kept
    ("request-level", 8192, 16, False, True),
    ("static", 8192, 16, False, True),
])
def test_every_constrained_output_matches_its_constraint(demo_model, policy, kv_tokens, block_size, chunked,
                                                         async_scheduling):
    engine = make_engine(demo_model, policy=policy, kv_tokens=kv_tokens, block_size=block_size, chunked=chunked,
                         async_scheduling=async_scheduling)
    requests = constrained()
    done = run(engine, requests)
    for rid, (_, params) in requests.items():
        assert done[rid].finish_reason is FinishReason.STOP, (rid, done[rid].text)
        check(params.structured_outputs, done[rid].text)
    if kv_tokens < 1000:
        assert engine.scheduler.num_preemptions > 0, "the test meant to force preemption"


def test_unconstrained_tokens_beside_constrained_ones_equal_those_alone_float64(demo_model):
    plain = {f"u{i}": (prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
             for i, prompt in enumerate(PROMPTS)}
    alone = run(make_engine(demo_model, dtype="float64"), plain)
    together = run(make_engine(demo_model, dtype="float64"), {**constrained(), **plain})
    assert {r: together[r].token_ids for r in plain} == {r: alone[r].token_ids for r in plain}


def test_a_seeded_constrained_request_draws_the_same_tokens_whatever_the_batch(demo_model):
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=7, structured_outputs=SPECS[0])
    alone = run(make_engine(demo_model), {"x": (PROMPTS[1], params)})
    crowded = run(make_engine(demo_model), {**constrained(), "x": (PROMPTS[1], params)})
    assert crowded["x"].token_ids == alone["x"].token_ids


def test_json_object_output_is_an_object_as_far_as_it_goes(demo_model):
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputs(json_object=True))
    done = run(make_engine(demo_model), {"a": (PROMPTS[0], params), "b": (PROMPTS[2], params)})
    for completion in done.values():
        assert completion.text.startswith("{")
        if completion.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(completion.text), dict)


def test_a_grammar_that_has_ended_finishes_the_request_even_with_ignore_eos(demo_model):
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True,
                            structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    done = run(make_engine(demo_model), {"a": (PROMPTS[0], params)})
    assert done["a"].finish_reason is FinishReason.STOP and done["a"].text in ("yes", "no")


def test_the_same_schema_is_compiled_once(demo_model):
    engine = make_engine(demo_model)
    run(engine, constrained(10))
    grammars = engine.runner.grammars
    assert len(grammars._compiled) == len(SPECS)
    assert not grammars._pending
    assert set(grammars.matchers) <= set(engine.runner.requests), "a matcher outlived its request's state"


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_bad_grammar_is_refused_before_it_reaches_the_engine(demo_model):
    engine = make_engine(demo_model)
    for bad, says in [(StructuredOutputs(regex="a(b"), "unclosed group"),
                      (StructuredOutputs(json={"type": "objekt"}), "objekt"),
                      (StructuredOutputs(grammar="start: foo"), "foo"),
                      (StructuredOutputs(json='{"type": '), "not JSON"),
                      (StructuredOutputs(regex="a", choice=["b"]), "exactly one"),
                      (StructuredOutputs(json=_nested(700)), "nested too deeply")]:
        with pytest.raises(ValueError, match=says):
            engine.add_request("bad", PROMPTS[0], SamplingParams(structured_outputs=bad))
    assert not engine.scheduler.requests


@pytest.mark.parametrize("recursion_limit", [1000, 100_000])  # Python's default; torch raises it when it compiles
def test_how_deep_a_schema_may_nest_does_not_depend_on_the_process(recursion_limit):
    """One limit (MAX_SCHEMA_DEPTH levels of objects and arrays) and one message, whether or not torch compiled
    in this process: before, a schema of 400 levels got llguidance's "recursion limit exceeded at line 1
    column 2491", one of 700 "nested too deeply" or the llguidance message, as Python's recursion limit was."""
    def items(levels: int) -> dict:  # one container per level
        schema: dict = {"type": "integer"}
        for _ in range(levels - 1):
            schema = {"type": "array", "items": schema}
        return schema

    before = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    deep_text = json.dumps(_nested(700))  # 1,401 levels as JSON text: deeper than json.dumps goes by default
    sys.setrecursionlimit(recursion_limit)
    try:
        StructuredOutputs(json=items(MAX_SCHEMA_DEPTH)).validate()
        StructuredOutputs(json=json.dumps(_nested(49))).validate()  # 99 levels, as JSON text
        for deep in (items(MAX_SCHEMA_DEPTH + 1), _nested(50), _nested(400), _nested(700), deep_text):
            with pytest.raises(ValueError, match=re.escape(f"invalid structured_outputs.json: {TOO_DEEP}")):
                StructuredOutputs(json=deep).validate()
    finally:
        sys.setrecursionlimit(before)


def test_logprobs_of_a_constrained_request_are_those_of_the_masked_distribution(demo_model):
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3,
                            structured_outputs=StructuredOutputs(choice=["ab", "cd"]))
    done = run(make_engine(demo_model), {"a": (PROMPTS[0], params)})
    masked = 0
    for lp in done["a"].logprobs:
        assert lp.logprob > -1e9
        assert all(value >= -9999.0 for _, value in lp.top), "a masked token is vLLM's floor, never -inf (null in JSON)"
        masked += sum(value == -9999.0 for _, value in lp.top)
    assert masked, "a position with fewer allowed tokens than asked for shows masked ones"


def test_a_choice_among_thousands_of_strings_is_one_of_them(demo_model):
    """More choices than llguidance's 2,000 parser items a row: they are one lexeme, which has no such bound.
    Some are prefixes of others, so the grammar may end or go on."""
    choices = [f"option {i}" for i in range(2500)] + ["no", "nope", "nonsense"]
    spec = StructuredOutputs(choice=choices).validate()
    requests = {f"r{i}": (PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=30, temperature=1.0, seed=i,
                                                                    structured_outputs=spec)) for i in range(4)}
    requests["greedy"] = (PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=spec))
    for rid, completion in run(make_engine(demo_model), requests).items():
        assert completion.finish_reason is FinishReason.STOP and completion.text in choices, (rid, completion.text)


def test_an_object_that_inherits_through_allof_takes_the_properties_of_both(demo_model):
    """pydantic's and OpenAPI's inheritance: closed objects are closed where allOf's branches meet."""
    schema = {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99}}, "required": ["id"]}},
              "allOf": [{"$ref": "#/$defs/Base"}], "type": "object",
              "properties": {"name": {"type": "string", "maxLength": 6}, "base": {"$ref": "#/$defs/Base"}},
              "required": ["name", "base"]}
    spec = StructuredOutputs(json=schema).validate()
    requests = {f"r{i}": (PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=80, temperature=1.0, seed=i,
                                                                    structured_outputs=spec)) for i in range(4)}
    for rid, completion in run(make_engine(demo_model), requests).items():
        assert completion.finish_reason is FinishReason.STOP, (rid, completion.text)
        value = json.loads(completion.text)
        jsonschema.validate(value, schema)
        assert set(value) <= {"id", "name", "base"} and set(value["base"]) == {"id"}, "no invented keys"


def test_the_bitmask_allows_exactly_its_set_bits():
    vocab = 70
    allowed = [{0, 31, 32, 69}, set(range(0, 70, 3))]
    bitmask = torch.zeros((2, 3), dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            word = int(bitmask[row, t // 32]) | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        logits = torch.randn(3, vocab).to(dtype)
        before = logits.clone()
        apply_token_bitmask(logits, [0, 2], bitmask)
        for row, tokens in zip([0, 2], allowed):
            finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
            assert finite == tokens
        assert torch.equal(logits[1], before[1]), "a row without a grammar is left alone"


def test_the_bitmask_applies_alike_when_every_row_is_constrained():
    bitmask = torch.tensor([[0b1011, 0], [-1, 1]], dtype=torch.int32)
    logits = torch.zeros(2, 40, dtype=torch.float64)
    apply_token_bitmask(logits, [0, 1], bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 1, 3]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == list(range(33))


def test_a_request_resumed_with_its_grammar_complete_may_only_end(demo_model):
    """A request resumed after its engine died (README, "When things fail") with tokens that already
    complete its grammar: its mask allows only EOS, and the next token ends it."""
    from transformers import AutoTokenizer

    from model.arch import eos_token_ids, load_arch_config
    from model.structured import GrammarMatchers

    eos = eos_token_ids(demo_model)
    grammars = GrammarMatchers(demo_model, load_arch_config(demo_model).vocab_size, eos)
    done_tokens = AutoTokenizer.from_pretrained(demo_model).encode("yes", add_special_tokens=False)
    grammars.open("r", StructuredOutputs(choice=["yes", "no"]), done_tokens)
    logits = torch.zeros(1, load_arch_config(demo_model).vocab_size)
    grammars.mask(logits, ["r"])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == sorted(eos)
    assert grammars.advance(["r"], [eos[0]]) == (["r"], {})


def test_a_choice_that_spells_a_special_token_ends_with_a_one_line_error(demo_model):
    """llguidance allows the special token `<|im_end|>` where the choice's text spells it, then refuses
    it (its forced bytes are tokenized with special tokens). The request ends with an error that says so
    in one line, not llguidance's parser state and grammar."""
    params = SamplingParams(max_tokens=20, temperature=0.0,
                            structured_outputs=StructuredOutputs(choice=["ab<|im_end|>x"]).validate())
    done = run(make_engine(demo_model), {"a": (PROMPTS[0], params), "b": (PROMPTS[1], SamplingParams(max_tokens=3))})
    assert done["b"].finish_reason is FinishReason.LENGTH, "the requests beside it go on"
    if done["a"].finish_reason is FinishReason.ERROR:
        assert "the grammar refused token" in done["a"].error and "\n" not in done["a"].error
    else:  # a later llguidance that keeps the text as text
        assert done["a"].text == "ab<|im_end|>x"

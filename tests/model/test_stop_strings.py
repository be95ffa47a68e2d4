"""Stop strings in the engine (`orca generate`'s path), with the random-weight demo model: the output ends
at the token that completes the stop string, with finish_reason stop, under every scheduling policy, the
static one included (it hands a lane's tokens over only when its whole batch ends), and also when that
token is the last one max_tokens allows."""

from __future__ import annotations

import msgspec
import pytest

from core.detokenize import IncrementalDetokenizer
from engine.llm_engine import LLMEngine
from engine.tokenizer import load_tokenizer
from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from shared.outputs import FinishReason
from shared.sampling import SamplingParams
from tests.model.test_structured_outputs import run as run_to_the_end

PROMPTS = {"a": [5, 9, 14, 3, 22], "b": [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]}
"""Two requests, so that the static policy runs them as one batch whose lanes end together."""


def run(model: str, policy: str, params: dict[str, SamplingParams]) -> dict:
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=model),
                                    scheduler=SchedulerConfig(policy=policy, max_num_seqs=4),
                                    cache=CacheConfig(kv_cache_tokens=4096, block_size=16)))
    return run_to_the_end(engine, {rid: (prompt, params[rid]) for rid, prompt in PROMPTS.items()})


def a_stop_string(model: str) -> tuple[str, list[int], str]:
    """A stop string that request a's greedy output completes at its 6th token or later: (the string, the
    tokens up to and including the one that completes it, the text before it)."""
    free = run(model, "orca", {rid: SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True) for rid in PROMPTS})
    tokens, text = free["a"].token_ids, free["a"].text
    for cut in range(len(text) - 2, 4, -1):
        stop = text[cut:cut + 2]
        if stop.strip() and text.find(stop) == cut:
            break
    else:
        pytest.skip("no two-character stop string occurs once in this output")
    detokenizer = IncrementalDetokenizer(load_tokenizer(model).decode, (stop,))
    for n, token in enumerate(tokens, 1):
        detokenizer.add((token,))
        if detokenizer.stopped:
            return stop, tokens[:n], text[:cut]
    raise AssertionError("the stop string never completed")


@pytest.fixture(scope="module")
def stop_case(demo_model):
    return a_stop_string(demo_model)


@pytest.mark.parametrize("policy", ["orca", "paged", "request-level", "static"])
def test_the_output_ends_at_the_token_that_completes_the_stop_string(demo_model, stop_case, policy):
    stop, tokens, before = stop_case
    params = {"a": SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,)),
              "b": SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)}
    done = run(demo_model, policy, params)
    assert done["a"].finish_reason is FinishReason.STOP
    assert done["a"].text == before
    assert done["a"].token_ids == tokens, "no token generated past the stop is the request's"
    assert done["b"].finish_reason is FinishReason.LENGTH and len(done["b"].token_ids) == 30
    assert (done["a"].stop_reason, done["b"].stop_reason) == (stop, None)


@pytest.mark.parametrize("policy", ["orca", "static"])
def test_a_stop_string_completed_by_the_last_token_max_tokens_allows_is_a_stop(demo_model, stop_case, policy):
    stop, tokens, before = stop_case
    params = {rid: SamplingParams(max_tokens=len(tokens), temperature=0.0, ignore_eos=True, stop=(stop,))
              for rid in PROMPTS}
    done = run(demo_model, policy, params)
    assert (done["a"].finish_reason, done["a"].text, done["a"].token_ids) == (FinishReason.STOP, before, tokens)


@pytest.mark.parametrize("stop", [(), ("never",)], ids=["no-stop-strings", "with-stop-strings"])
def test_a_stop_token_ends_the_request_without_its_text(demo_model, stop):
    """vLLM's rule: the stop token id stays in token_ids (and the usage) but its text is left out."""
    forced = SamplingParams(max_tokens=5, temperature=0.0, logit_bias={42: 100.0}, stop=stop)
    tokenizer = load_tokenizer(demo_model)
    done = run(demo_model, "orca", {"a": msgspec.structs.replace(forced, stop_token_ids=(42,)), "b": forced})
    assert (done["a"].token_ids, done["a"].text, done["a"].finish_reason) == ([42], "", FinishReason.STOP)
    assert done["b"].token_ids == [42] * 5 and done["b"].text == tokenizer.decode([42] * 5) != ""
    assert (done["a"].stop_reason, done["b"].stop_reason) == (42, None)


def test_min_tokens_holds_back_eos_stop_tokens_and_stop_strings(demo_model):
    """vLLM's min_tokens: EOS forced by a logit bias, a stop token id, a stop string, none ends the request
    before min_tokens tokens are out; then each ends it at once."""
    from model.arch import eos_token_ids

    eos = eos_token_ids(demo_model)[0]
    base = SamplingParams(max_tokens=12, temperature=0.0)
    done = run(demo_model, "orca", {
        "a": msgspec.structs.replace(base, logit_bias={eos: 100.0}, min_tokens=4),
        "b": msgspec.structs.replace(base, logit_bias={42: 100.0}, stop_token_ids=(42,), min_tokens=3)})
    assert (len(done["a"].token_ids), done["a"].token_ids[-1], done["a"].finish_reason) == (5, eos, FinishReason.STOP)
    assert eos not in done["a"].token_ids[:4]
    assert done["b"].token_ids[3] == 42 and len(done["b"].token_ids) == 4 and 42 not in done["b"].token_ids[:3]


def test_min_tokens_stop_strings_match_only_after_them():
    """vLLM's rule: a stop string must end in the text of a token after the first min_tokens (as EOS can
    come first at token min_tokens + 1), not in the text of those tokens."""
    def run(stop: tuple[str, ...], min_tokens: int, tokens: bytes) -> tuple[str, bool]:
        detok = IncrementalDetokenizer(lambda ids: bytes(ids).decode(), stop=stop, min_tokens=min_tokens)
        out = "".join(detok.add([t]) for t in tokens) + detok.flush()
        assert out == detok.text
        return out, detok.stopped

    assert run(("x",), 3, b"xax") == ("xax", False)
    assert run(("x",), 3, b"xaxx") == ("xax", True)
    assert run(("ab",), 2, b"abc") == ("abc", False)  # "ab" ended in token 2
    assert run(("ab",), 1, b"abc") == ("", True)  # in token 2: it straddles the first token's text


def test_min_tokens_past_max_tokens_or_with_a_constraint_is_refused():
    from shared.structured import StructuredOutputs

    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3).validate()
    with pytest.raises(ValueError, match="structured outputs"):
        SamplingParams(min_tokens=1, structured_outputs=StructuredOutputs(regex="a+")).validate()


def test_special_tokens_are_text_when_asked_and_stop_strings_can_be_kept(demo_model):
    """vLLM's skip_special_tokens=false and include_stop_str_in_output, through the engine."""
    from model.arch import eos_token_ids

    tokenizer = load_tokenizer(demo_model)
    eos = eos_token_ids(demo_model)[0]
    forced = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logit_bias={eos: 100.0})
    done = run(demo_model, "orca", {"a": forced, "b": msgspec.structs.replace(forced, skip_special_tokens=False)})
    assert done["a"].token_ids == done["b"].token_ids == [eos, eos]
    assert done["a"].text == "" and done["b"].text == tokenizer.decode([eos, eos], skip_special_tokens=False) != ""


def test_the_stop_string_stays_in_the_text_when_asked(demo_model, stop_case):
    stop, tokens, before = stop_case
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,),
                            include_stop_str_in_output=True)
    done = run(demo_model, "orca", {"a": params, "b": SamplingParams(max_tokens=2, temperature=0.0)})
    assert (done["a"].text, done["a"].token_ids, done["a"].finish_reason) == (before + stop, tokens, FinishReason.STOP)


def test_eos_with_special_tokens_kept_ends_the_text_without_its_own(demo_model):
    """skip_special_tokens off: EOS's text (`</s>`) is not the output's, as vLLM leaves out the token a
    request stopped on; an EOS the request also lists in stop_token_ids gives stop_reason null (EOS comes
    first), and every EOS of the checkpoint reaches the tokenizer the services load."""
    tokenizer = load_tokenizer(demo_model, control_plane=True)
    eos = tokenizer.eos_token_ids[0]
    assert tokenizer.decode([eos], skip_special_tokens=False) != ""
    forced = SamplingParams(max_tokens=5, temperature=0.0, logit_bias={eos: 100.0}, skip_special_tokens=False)
    done = run(demo_model, "orca", {"a": forced, "b": msgspec.structs.replace(forced, stop_token_ids=(eos,))})
    for rid in "ab":
        assert (done[rid].token_ids, done[rid].text, done[rid].finish_reason) == ([eos], "", FinishReason.STOP)
        assert done[rid].stop_reason is None

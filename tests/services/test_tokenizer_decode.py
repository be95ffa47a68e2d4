"""The tokenizer wrapper's decode is transformers' decode, whichever path it takes."""

import random

import pytest
from transformers import AutoTokenizer

from engine.tokenizer import Tokenizer, load_tokenizer


@pytest.mark.parametrize("model", ["demo_model", "demo_gpt2"])
def test_decode_equals_transformers_on_random_ids_special_tokens_included(model, request):
    path = request.getfixturevalue(model)
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    rng = random.Random(0)
    specials = list(theirs.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randrange(0, 12))]
        if specials and rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), ids


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(demo_model):
    hf = AutoTokenizer.from_pretrained(demo_model)
    hf.clean_up_tokenization_spaces = True
    hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = hf.encode("a , b . c", add_special_tokens=False)
    cleaned = hf.decode(ids, skip_special_tokens=True)
    assert cleaned != hf.backend_tokenizer.decode(ids, skip_special_tokens=True)  # the clean-up matters here
    assert Tokenizer(hf).decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_a_resumed_stream_continues_the_text_exactly_whatever_token_it_stopped_after(demo_model):
    """The chaos test's greedy output: lone bytes (token 141, 'Í' without its continuation) that no
    character completes, between whole words. A stream cut after any token and resumed elsewhere (its
    tokens primed into a new detokenizer) must send exactly the rest of the text."""
    from types import SimpleNamespace

    from core.detokenize import IncrementalDetokenizer
    from services.tokenizer.recovery import prime

    tokenizer = load_tokenizer(demo_model)
    tokens = [1337, 1337, 2504, 3356, 3356, 141, 141, 141, 3356, 3356, 141, 141, 3356, 2289, 2289]
    whole = tokenizer.decode(tokens)
    assert "\ufffd" in whole
    for cut in range(len(tokens) + 1):
        first = IncrementalDetokenizer(tokenizer.decode)
        sent = "".join(first.add((t,)) for t in tokens[:cut])
        resumed = SimpleNamespace(detokenizer=IncrementalDetokenizer(tokenizer.decode), num_generated=0)
        prime(resumed, tokens[:cut])
        rest = "".join(resumed.detokenizer.add((t,)) for t in tokens[cut:]) + resumed.detokenizer.flush()
        assert sent + rest == whole, cut
        assert resumed.num_generated == cut

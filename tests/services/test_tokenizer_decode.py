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

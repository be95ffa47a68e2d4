"""Whatever bytes arrive on NATS, decoding gives a message or a clear error, never a crash."""

from __future__ import annotations

import json

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.api import decode_abort, decode_generate_request
from shared.codec import Codec
from shared.messages import Admit, Cancel, EngineStatus, IterationOutputs, TokenizedRequest

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20,
)
fields = st.sampled_from(["id", "prompt", "prompt_token_ids", "messages", "max_tokens", "temperature", "top_p",
                          "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs",
                          "repetition_penalty", "presence_penalty", "frequency_penalty", "priority", "other"])


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(fields, json_values, max_size=8))
def test_generate_requests_decode_or_name_the_problem(body):
    try:
        request = decode_generate_request(json.dumps(body))
        request.sampling_params()
    except ValueError as exc:
        assert str(exc)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_refused_cleanly(data):
    for decode in (decode_generate_request, decode_abort):
        try:
            decode(data)
        except ValueError:
            pass
    for type_ in (TokenizedRequest, Admit, Cancel, EngineStatus, IterationOutputs):
        try:
            Codec(type_).decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass

"""How a chat prompt ends (vLLM's add_generation_prompt and continue_final_message) over NATS and in
`orca generate`, with the demo model's real chat template: an assistant turn opened by default, or the last
(assistant) message left open for the reply to continue it."""

from __future__ import annotations

import msgspec
import pytest

from engine.tokenizer import load_tokenizer, render_messages
from shared.api import GenerateRequest


def request(**fields) -> GenerateRequest:
    body = {"id": "r", "messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "Sure, the"}], **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=GenerateRequest)


def test_the_last_assistant_message_is_left_open_to_continue(demo_model):
    tokenizer = load_tokenizer(demo_model, control_plane=True)
    opened = tokenizer.decode(render_messages(tokenizer, request()), skip_special_tokens=False)
    continued = tokenizer.decode(render_messages(tokenizer, request(add_generation_prompt=False,
                                                                    continue_final_message=True)),
                                 skip_special_tokens=False)
    assert continued.endswith("Sure, the"), continued
    assert not opened.endswith("Sure, the") and opened.startswith(continued)


@pytest.mark.parametrize("fields,words", [
    ({"continue_final_message": True}, "needs add_generation_prompt false"),
    ({"add_generation_prompt": False, "continue_final_message": True, "messages": [{"role": "user", "content": "x"}]},
     "an assistant's; it is 'user'"),
    ({"messages": None, "prompt": "x", "add_generation_prompt": False}, "need messages"),
])
def test_what_cannot_be_rendered_so_is_refused(fields, words):
    with pytest.raises((ValueError, msgspec.ValidationError), match=words):
        request(**fields)

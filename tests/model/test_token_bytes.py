"""Each token's own bytes (the logprob `bytes` of OpenAI's chat API): a token that is part of a character
decodes alone to U+FFFD, so its bytes come from the vocabulary, and the bytes of a text's tokens join to
the text. Byte-level BPE (the demo model, GPT-2, Llama 3, Qwen) and byte-fallback pieces (<0xE9>)."""

from __future__ import annotations

from engine.tokenizer import Tokenizer, load_tokenizer
from services.gateway.responses import chat_logprobs


def test_the_bytes_of_a_texts_tokens_join_to_the_text(demo_model):
    tokenizer = load_tokenizer(demo_model, control_plane=True)
    text = "naïve 日本語 🙂, ok"
    ids = tokenizer.encode(text)
    assert "\ufffd" in "".join(tokenizer.decode([t]) for t in ids), "some token is part of a character"
    assert b"".join(tokenizer.token_bytes(t) for t in ids).decode() == text  # BOS, special, has no bytes


def test_chat_logprobs_carry_each_tokens_own_bytes(demo_model):
    tokenizer = load_tokenizer(demo_model, control_plane=True)
    ids = [t for t in tokenizer.encode("日") if tokenizer.token_bytes(t)]
    entries = [{"token_id": t, "logprob": -1.0, "top_logprobs": [{"token_id": t, "logprob": -1.0}]} for t in ids]
    content = chat_logprobs(entries, lambda t: tokenizer.decode([t]), tokenizer.token_bytes)["content"]
    assert bytes(b for c in content for b in c["bytes"]).decode() == "日"
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]


class ByteFallbackVocabulary:
    """A SentencePiece-style tokenizer's surface: `<0xE6>` pieces for bytes, no byte-level decoder."""

    eos_token_id = None
    all_special_ids = [0]
    PIECES = {0: "<s>", 1: "<0xE6>", 2: "<0x97>", 3: "<0xA5>", 4: "▁hi"}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.PIECES[token_id]

    def decode(self, ids, skip_special_tokens=True) -> str:
        data = "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 0))
        return data.replace("▁", " ") if "<0x" not in data else "\ufffd"


def test_byte_fallback_pieces_are_their_byte():
    tokenizer = Tokenizer(ByteFallbackVocabulary())
    assert [tokenizer.token_bytes(t) for t in range(5)] == [b"", b"\xe6", b"\x97", b"\xa5", b" hi"]

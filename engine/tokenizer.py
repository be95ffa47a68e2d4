"""The checkpoint's tokenizer behind a small interface (encode, decode, chat template)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class Tokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        self._tok = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("this model has no chat template; use a plain prompt")
        ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The tokenizer saved beside the weights, or None when the checkpoint has none."""
    if not any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # heavy import, only where a tokenizer is used

    return Tokenizer(AutoTokenizer.from_pretrained(str(model_dir)))

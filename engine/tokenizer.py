"""The checkpoint's tokenizer behind a small interface (encode, decode, chat template)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.api import ChatTurn, GenerateRequest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
JINJA_CHARS = "{}\n"
"""A --chat-template value with one of these is template text; without, it must name a file (vLLM's rule)."""


@functools.lru_cache(maxsize=8)
def load_chat_template(value: str) -> str:
    """A `--chat-template` value as template text: the file it names, or the value itself when it is
    a template. ValueError when it names no file and does not look like a template either."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # template text too long (or odd) to be a path
        is_file = False
    if is_file:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value!r}: cannot read it ({exc})") from None
    if any(c in value for c in JINJA_CHARS):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character each byte is written as in a
    byte-level BPE vocabulary -> that byte (printable bytes stand for themselves, the others are moved
    past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, moved = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + moved)] = byte
            moved += 1
    return chars


BYTE_OF_CHAR = _byte_of_char()


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, chat_template: str | None = None) -> None:
        """`chat_template`: a `--chat-template` value (a file or the text), used instead of the checkpoint's."""
        self._tok = hf_tokenizer
        # A fast tokenizer's Rust core decodes as transformers' `decode` does, less its Python layers (1.5
        # against 5.3 us for a few tokens; the tokenizer service decodes twice per streamed token), unless
        # transformers would also clean up the spaces afterwards.
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._backend_decode = (backend.decode if backend is not None
                                and not getattr(hf_tokenizer, "clean_up_tokenization_spaces", False) else None)
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = () if self.eos_token_id is None else (self.eos_token_id,)
        """Every id the model stops on (load_tokenizer adds the checkpoint's config and generation config)."""
        self.chat_template: str | None = (load_chat_template(chat_template) if chat_template
                                          else getattr(hf_tokenizer, "chat_template", None) or None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens`: the tokenizer's own around the text (a BOS), as transformers' default."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    @functools.lru_cache(maxsize=65_536)  # noqa: B019 - one tokenizer per process, a vocabulary's worth of entries
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for (OpenAI's logprob `bytes`): a byte-level BPE token that is part of a
        character decodes alone to U+FFFD, whose bytes are not its own, nor a byte-fallback token's (<0xE9>)."""
        piece = self._tok.convert_ids_to_tokens(token_id)
        if piece is None or token_id in self._special_ids:
            return self.decode([token_id]).encode()
        if self._byte_level:
            try:
                return bytes(BYTE_OF_CHAR[c] for c in piece)
            except KeyError:  # an added token, not made of bytes
                return self.decode([token_id]).encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.decode([token_id]).encode()

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether its decoder is GPT-2's byte level one (each character of a token stands for one byte)."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        return decoder is not None and "ByteLevel" in repr(decoder)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(getattr(self._tok, "all_special_ids", ()))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                            chat_template: str | None = None, turn: ChatTurn | None = None,
                            template_kwargs: dict[str, Any] | None = None,
                            documents: list[dict[str, Any]] | None = None) -> list[int]:
        """The messages rendered for a reply. `tools`: transformers' `tools=` (the template offers them);
        `chat_template`: a `--chat-template` value for this call, over the tokenizer's own; `turn`: how the
        prompt ends (default: an opened assistant turn); `template_kwargs`: vLLM's chat_template_kwargs, more
        variables for the template (Qwen3's `enable_thinking`); `documents`: for a retrieval template."""
        template = load_chat_template(chat_template) if chat_template else self.chat_template
        if not template:
            raise ValueError("this model has no chat template; use a plain prompt (or give --chat-template)")
        check_template_kwargs(template_kwargs)
        add, continue_final = (True, False) if turn is None else (turn.add_generation_prompt,
                                                                   turn.continue_final_message)
        ids = self._tok.apply_chat_template(messages, tools=tools, documents=documents, chat_template=template,
                                            add_generation_prompt=add, continue_final_message=continue_final,
                                            tokenize=True, **(template_kwargs or {}))
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""What the request's own fields set, or how transformers renders: not a chat_template_kwargs key."""


def check_template_kwargs(template_kwargs: dict[str, Any] | None) -> None:
    taken = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {}))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {taken[0]!r}: the request's own fields, or the "
                         f"rendering, decide it")


def render_messages(tokenizer: Tokenizer, request: GenerateRequest, chat_template: str | None = None) -> list[int]:
    """A NATS or `orca generate` request's chat messages (and tools) rendered with the chat template."""
    import msgspec

    from shared.tools import template_messages, template_tools

    # content "" where an assistant message made only tool calls, as the gateway renders it
    messages = template_messages([{**msgspec.to_builtins(m), "content": m.content or ""}
                                  for m in request.messages or ()])
    tools = template_tools(request.tools, request.tool_choice)
    try:
        return tokenizer.apply_chat_template(messages, tools, chat_template, request.chat_turn(),
                                             request.chat_template_kwargs)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - a Jinja error (a template's raise_exception) is still about the messages
        raise ValueError(f"the chat template rejected the messages: {exc}") from None


def load_tokenizer(model_dir: str | Path, chat_template: str | None = None, *,
                   control_plane: bool = False) -> Tokenizer | None:
    """The tokenizer saved beside the weights, or None when the checkpoint has none. `chat_template`:
    a `--chat-template` value (a Jinja file or the template text) that replaces the checkpoint's.
    `control_plane`: this process runs no model (the tokenizer service, the gateway), so transformers
    is loaded as if torch were not installed (`_transformers_without_torch`)."""
    if not any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES):
        return None
    if control_plane:
        _transformers_without_torch()
    from transformers import AutoTokenizer  # heavy import, only where a tokenizer is used

    tokenizer = Tokenizer(AutoTokenizer.from_pretrained(str(model_dir)), chat_template)
    tokenizer.eos_token_ids = model_eos_ids(model_dir, tokenizer.eos_token_id)
    return tokenizer


def model_eos_ids(model_dir: str | Path, tokenizer_eos_id: int | None) -> tuple[int, ...]:
    """The EOS ids of config.json and generation_config.json (Llama 3 lists several), and the tokenizer's
    (alone, for a tokenizer saved without a model's config)."""
    from model.arch import eos_token_ids  # torch-free: reads the two JSON files

    try:
        ids = eos_token_ids(model_dir)
    except ValueError:  # no config.json, or one of a model this engine does not run
        ids = ()
    if tokenizer_eos_id is not None and tokenizer_eos_id not in ids:
        ids += (tokenizer_eos_id,)
    return ids


def _transformers_without_torch() -> None:
    """Have transformers, from here on in this process, behave as it does where torch is not installed,
    which it supports for tokenizers. Otherwise AutoTokenizer imports torch through its config classes:
    1.5 s more to start and 250 MB more memory in a process that never runs a model. Only before
    transformers' config classes are imported, and never where torch already is (a model process)."""
    if "torch" in sys.modules or "transformers.configuration_utils" in sys.modules:
        return
    import transformers.utils
    import transformers.utils.import_utils

    def torch_is_not_available() -> bool:
        return False

    transformers.utils.import_utils.is_torch_available = torch_is_not_available
    transformers.utils.is_torch_available = torch_is_not_available

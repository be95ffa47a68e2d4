"""Incremental detokenization and stop-string matching for one request.

Decoding only the newest token garbles multi-byte characters and breaks the spacing of
many tokenizers, so the text is decoded over a short window of tokens and only the part
that is final (no trailing U+FFFD) is emitted, as TGI and vLLM do. Pure: the tokenizer's
`decode` is injected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.sampling import SamplingParams

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                 min_tokens: int = 0, include_stop: bool = False, eos_token_ids: Sequence[int] = ()) -> None:
        """`min_tokens`: stop strings match only in the text of the tokens after the first this many (vLLM's
        min_tokens); `eos_token_ids`: the model's, where it stops unless `ignore_eos` (then they are not
        `stop_reason`, even if also among the stop token ids: vLLM checks EOS first);
        `include_stop`: the text keeps the stop string, or the stop token's text, that ended it."""
        self._decode = decode
        self._stop = tuple(stop)
        self._stop_token_ids = frozenset(stop_token_ids)
        self._eos_token_ids = frozenset(eos_token_ids)
        self._min_tokens = min_tokens
        self._include_stop = include_stop
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self._emitted = 0
        self.stopped = False
        self.stop_reason: str | int | None = None
        """What ended the request, as vLLM's `stop_reason`: the stop string that matched, or the stop token
        id it ended on; None for anything else (EOS, the length, an abort)."""

    @classmethod
    def of(cls, decode: Callable[..., str], params: SamplingParams,
           eos_token_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        """The detokenizer of a request with these parameters; `decode(ids, skip_special_tokens=...)`."""
        if not params.skip_special_tokens:
            decode = functools.partial(decode, skip_special_tokens=False)
        return cls(decode, params.stop, params.stop_token_ids, params.min_tokens, params.include_stop_str_in_output,
                   () if params.ignore_eos else eos_token_ids)

    @property
    def watches_stop_strings(self) -> bool:
        return bool(self._stop)

    @property
    def token_ids(self) -> list[int]:
        """Every token added so far (read only): what a resumed request already has."""
        return self._tokens

    def add(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the new final text (after a stop string matches: nothing more)."""
        if self.stopped:
            return ""
        self._tokens.extend(token_ids)
        prefix = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return self._append(delta)

    def add_until_stop(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """Add tokens one at a time until one completes a stop string: (the new final text, how many
        tokens were taken). The tokens after that one are not the request's: an engine that hands over
        several at once (a lane of the static policy) generated them past the stop."""
        if not self._stop or len(token_ids) <= 1:
            return ("", 0) if self.stopped else (self.add(token_ids), len(token_ids))
        text, taken = "", 0
        for token in token_ids:
            if self.stopped:
                break
            text += self.add((token,))
            taken += 1
        return text, taken

    def add_output(self, token_ids: Sequence[int], engine_stopped: bool) -> tuple[str, int]:
        """add_until_stop for an engine's output; `engine_stopped`: its finish reason is stop. A request
        that ended on EOS or one of its stop token ids keeps that token (in its ids, its usage) but not its
        text (with skip_special_tokens off, EOS has one), as vLLM leaves it out unless
        include_stop_str_in_output; a stop string's text is left out likewise."""
        decoded = token_ids
        last = token_ids[-1] if engine_stopped and token_ids else None
        # not the last token of a grammar's end, which is the output's own (a JSON object's closing brace)
        on_stop_token = last in self._stop_token_ids or last in self._eos_token_ids
        if on_stop_token and not self._include_stop:
            decoded = token_ids[:-1]
        text, taken = self.add_until_stop(decoded) if decoded else ("", 0)
        if taken == len(decoded) and not self.stopped:
            taken = len(token_ids)
            if on_stop_token and last not in self._eos_token_ids:
                self.stop_reason = last
        return text, taken

    def flush(self) -> str:
        """At the end of a request: the text held back (the tokens after the last complete character,
        and the tail kept while it could still turn out to start a stop string). The bytes of a
        character that never completed are dropped, as vLLM drops them (decoded, they are U+FFFD)."""
        out = ""
        if not self.stopped and self._read_offset < len(self._tokens):
            prefix = self._decode(self._tokens[self._prefix_offset:self._read_offset])
            full = self._decode(self._tokens[self._prefix_offset:])
            self._read_offset = len(self._tokens)
            out = self._append(full[len(prefix):].rstrip("\ufffd"))
        out += self.text[self._emitted:]
        self._emitted = len(self.text)
        return out

    def _append(self, delta: str) -> str:
        longest = max((len(s) for s in self._stop), default=0)
        searched = len(self.text)  # each stop string is looked for where it would end in the new text
        self.text += delta
        stops = self._stop if len(self._tokens) > self._min_tokens else ()
        matches = [(at, -len(s), s) for s in stops if (at := self.text.find(s, max(0, searched - len(s) + 1))) >= 0]
        if matches:
            at, minus_len, self.stop_reason = min(matches)  # the first match; of two there, the longer
            self.text = self.text[:at - minus_len if self._include_stop else at]
            self.stopped = True
        # Hold back a tail that could be the start of a stop string still being generated.
        hold = 0 if self.stopped or not longest else longest - 1
        end = max(self._emitted, len(self.text) - hold)
        out = self.text[self._emitted:end]
        self._emitted = end
        return out

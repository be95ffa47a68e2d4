"""A streamed chat choice of a request with tools: its text in as it comes, OpenAI's deltas out.

- a named function: the output is the call's arguments, so they stream as they come (the first
  delta carries the call's id, type and name with arguments "", as OpenAI's do).
- `required`: the output is a JSON array of calls that is only known to parse once it is whole, so
  the tool_calls deltas leave at the end, one per call with all its arguments (vLLM streams them
  the same way once a call is complete); cut short by max_tokens, it is content instead.
- `auto`: content streams until the model opens a Hermes `<tool_call>` block; text that may be the
  start of one is held back, and what follows it waits for the end, to be read as calls (or sent as
  content, when it does not parse as any).
"""

from __future__ import annotations

import uuid

import msgspec

from services.gateway.constraints import ToolUse
from shared.tools import HERMES_OPEN, ToolCall


class ToolStream:
    def __init__(self, tools: ToolUse) -> None:
        self.tools = tools
        self.text = ""
        self.sent = 0
        """How much of `text` has left as content (auto) or as arguments (a named function)."""
        self.started = False
        self.called = False
        """Known at the end: the output was tool calls."""
        self.call_id = f"call_{uuid.uuid4().hex[:24]}"

    def add(self, text: str) -> list[dict]:
        """The deltas for the next piece of the output (none while it is held back)."""
        self.text += text
        first, self.started = not self.started, True
        if self.tools.named is not None:
            out = [_call_delta(0, self.call_id, self.tools.named, "")] if first else []
            return out + self._arguments()
        if self.tools.choice == "auto":
            return self._content()
        return []

    def finish(self) -> list[dict]:
        """The deltas that end the output; `called` then says whether the model called tools."""
        if self.tools.named is not None:
            self.called = True
            return self._arguments()
        if self.tools.choice == "auto" and HERMES_OPEN not in self.text:
            return self._rest()
        _, calls = self.tools.parse(self.text)
        if not calls:
            return self._rest()
        self.called = True
        return [{"tool_calls": [_full_delta(i, call) for i, call in enumerate(calls)]}]

    def _arguments(self) -> list[dict]:
        fragment, self.sent = self.text[self.sent:], len(self.text)
        return [{"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}] if fragment else []

    def _content(self) -> list[dict]:
        # Nothing of a `<tool_call>` is ever sent (a possible start of one is held back), so it can
        # only begin at or after `sent`.
        opened = self.text.find(HERMES_OPEN, self.sent)
        end = max(self.sent, opened if opened >= 0 else len(self.text) - _partial_open(self.text))
        piece, self.sent = self.text[self.sent:end], end
        return [{"content": piece}] if piece else []

    def _rest(self) -> list[dict]:
        piece, self.sent = self.text[self.sent:], len(self.text)
        return [{"content": piece}] if piece else []


def _partial_open(text: str) -> int:
    """The length of the longest end of `text` that is the beginning of `<tool_call>`."""
    for n in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-n:]):
            return n
    return 0


def _call_delta(index: int, call_id: str, name: str, arguments: str) -> dict:
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": arguments}}]}


def _full_delta(index: int, call: ToolCall) -> dict:
    return {"index": index, **msgspec.to_builtins(call)}

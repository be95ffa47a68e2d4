"""Tool calling (OpenAI's `tools` and `tool_choice`): checking them, the constraint they put on the
output, and the tool calls read back from it. Shared by the gateway, the NATS tokenizer and `orca generate`.

- `required`: the output is a JSON array of one or more `{"name", "parameters"}` objects, each naming a
  given function and matching its parameter schema (vLLM's encoding).
- a named function: the output is that function's arguments, matching its parameter schema.
- `auto`: nothing is constrained; the checkpoint's chat template offers the tools, and calls the model
  writes the Hermes way (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, Qwen's and Hermes'
  templates) are read back; anything else is plain content.
- `none`: no tool calls.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

import msgspec

from shared.structured import StructuredOutputs


class FunctionDefinition(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class FunctionName(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    function: FunctionName
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(msgspec.Struct, frozen=True):
    name: str
    """One of the request's `tools`, by its function's name."""
    arguments: str
    """JSON text, as OpenAI sends it."""


class ToolCall(msgspec.Struct, frozen=True):
    """A call the model made, as OpenAI returns it in `message.tool_calls`."""

    id: str
    """`call_<random>`: the client answers the call with a `tool` message of this id."""
    function: FunctionCall
    type: str = "function"


NO_PARAMETERS = {"type": "object", "properties": {}}
HERMES_OPEN = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def effective_choice(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> ToolChoice:
    """OpenAI's default: `auto` when tools are given, else `none`."""
    if tool_choice is not None:
        return tool_choice
    return "auto" if tools else "none"


def check_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> None:
    """ValueError naming the problem: a bad name, a duplicate, a schema that is not an object, a choice
    that names no given tool or asks for tools without any."""
    tools = tools or []
    names = [t.function.name for t in tools]
    for name in names:
        if not _NAME.match(name):
            raise ValueError(f"tools: function name {name!r} must be 1-64 letters, digits, _ . or -")
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ValueError(f"tools: function {duplicate!r} is given twice")
    for tool in tools:
        if tool.function.parameters is not None and tool.function.parameters.get("type", "object") != "object":
            raise ValueError(f"tools: function {tool.function.name!r}: parameters must be a JSON schema of an object")
    choice = effective_choice(tools, tool_choice)
    if choice != "none":  # offered to the model: each schema must be one a constraint could enforce
        for name in names:
            _parameters(tools, name)
    if choice == "required" and not tools:
        raise ValueError("tool_choice 'required' needs tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")


def tool_constraint(tools: list[Tool] | None, tool_choice: ToolChoice | None,
                    parallel: bool = True) -> StructuredOutputs | None:
    """What the output must match for this tool choice (None: unconstrained). `parallel=False`
    (OpenAI's parallel_tool_calls): `required` allows one call only. ValueError names a function
    whose parameter schema cannot constrain an output."""
    choice = effective_choice(tools, tool_choice)
    by_name = {t.function.name: t.function for t in tools or []}
    if isinstance(choice, NamedToolChoice):
        return StructuredOutputs(json=_parameters(tools or [], choice.function.name))
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                   "parameters": _parameters(tools or [], name)},
                  "required": ["name", "parameters"]} for name in by_name]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredOutputs(json={**array, "maxItems": 1} if not parallel else array)
    return None


def _parameters(tools: list[Tool], name: str) -> dict[str, Any]:
    """The named function's parameter schema, checked on its own so that an error names the function."""
    index, fn = next((i, t.function) for i, t in enumerate(tools) if t.function.name == name)
    # OpenAI's parameters are an object's schema even when they leave `type` out; as given, such a
    # schema would let the arguments be any JSON value.
    parameters = fn.parameters or NO_PARAMETERS
    if "type" not in parameters:
        parameters = {"type": "object", **parameters}
    try:
        StructuredOutputs(json=parameters).validate()
    except ValueError as exc:
        raise ValueError(str(exc).replace("structured_outputs.json", f"tools[{index}].function.parameters "
                                                                     f"({name!r})")) from None
    return parameters


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (as plain dicts) the way chat templates take them: OpenAI's `developer` role as
    `system`, absent fields left out (templates test `message.tool_calls is defined`), and a tool
    call's arguments as an object, transformers' convention (templates write them with `tojson`;
    vLLM converts them the same way)."""
    out = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        if message.get("role") == "developer":
            message["role"] = "system"
        if message.get("tool_calls"):
            message["tool_calls"] = [_template_call(call) for call in message["tool_calls"]]
        out.append(message)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
            if isinstance(parsed, dict):
                function["arguments"] = parsed
        except json.JSONDecodeError:
            pass  # not JSON: the template gets the text as it came
    return {**call, "function": function}


def template_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> list[dict] | None:
    """The tools as a chat template takes them (transformers' `tools=`), or None when none are offered."""
    if not tools or effective_choice(tools, tool_choice) == "none":
        return None
    return [msgspec.to_builtins(t) for t in tools]


def parse_tool_calls(text: str, tools: list[Tool] | None, tool_choice: ToolChoice | None,
                     parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) read from a finished output. Constrained outputs always parse, unless cut
    short by max_tokens: then they are returned as content, as vLLM does. `parallel=False` keeps the
    first call only."""
    choice = effective_choice(tools, tool_choice)
    if isinstance(choice, NamedToolChoice):
        return None, [_call(choice.function.name, text)]
    if choice == "required":
        try:
            calls = [_call(c.name, _arguments(c.parameters)) for c in _required_calls.decode(text)]
        except (msgspec.DecodeError, msgspec.ValidationError):
            return text, []
        return (None, calls[:1] if not parallel else calls) if calls else (text, [])
    if choice == "auto":
        names = {t.function.name for t in tools or []}
        calls = []
        for block in _HERMES_CALL.findall(text):
            try:
                call = _hermes_call.decode(block)
                if call.name in names:
                    calls.append(_call(call.name, _arguments(call.arguments)))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
        if calls:
            # What came before the first call, as it streamed (vLLM's Hermes parser keeps it whole too).
            content = text[:text.find(HERMES_OPEN)]
            return content or None, calls[:1] if not parallel else calls
    return text, []


class _RequiredCall(msgspec.Struct):
    """One element of the array a `required` choice constrains the output to."""

    name: str
    parameters: msgspec.Raw


class _HermesCall(msgspec.Struct):
    name: str
    arguments: msgspec.Raw = msgspec.Raw(b"{}")


_required_calls = msgspec.json.Decoder(list[_RequiredCall])
_hermes_call = msgspec.json.Decoder(_HermesCall)


def _arguments(raw: msgspec.Raw) -> str:
    """A call's arguments as the model wrote them: the JSON text itself, never parsed and written again
    (a float would lose digits, and 1e999 come back as Infinity, which is not JSON). A model may have
    written them as a JSON string of the text instead."""
    text = bytes(raw).decode()
    return msgspec.json.decode(text, type=str) if text.startswith('"') else text


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", FunctionCall(name, arguments))

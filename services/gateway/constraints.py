"""What a request's output must match, and its tools: from `response_format`, vLLM's
`structured_outputs` (or its older `guided_*` fields) and chat's `tools` / `tool_choice`.

Checked before anything is tokenized or published: a bad schema, regex or grammar, an unknown
function, or a constraint given twice is a 400 that names the field, and never reaches an engine.
The gateway sends token ids, so the constraint travels as the GenerateRequest's `structured_outputs`
and the tool calls are read back here (shared/tools.py has the rules; the NATS tokenizer and
`orca generate` use the same ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from services.gateway.errors import APIError
from services.gateway.openai_types import ChatCompletionRequest, JsonSchemaFormat, SamplingFields
from shared.structured import StructuredOutputs
from shared.tools import (NamedToolChoice, Tool, ToolCall, ToolChoice, check_tools, effective_choice,
                          parse_tool_calls, template_tools, tool_constraint)


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools, when the model may call them (tool_choice is not `none`)."""

    tools: list[Tool]
    choice: ToolChoice
    """auto, required or a named function (never none: then there is no ToolUse)."""
    parallel: bool = True

    @property
    def named(self) -> str | None:
        """The function tool_choice names, if it names one."""
        return self.choice.function.name if isinstance(self.choice, NamedToolChoice) else None

    def template_tools(self) -> list[dict] | None:
        return template_tools(self.tools, self.choice)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return parse_tool_calls(text, self.tools, self.choice, self.parallel)


def tool_use(body: ChatCompletionRequest) -> ToolUse | None:
    """The request's tools, checked (names, duplicates, a choice that names no given function)."""
    tools = [msgspec.convert(t.model_dump(exclude_none=True), Tool) for t in body.tools or ()]
    choice = (msgspec.convert(body.tool_choice.model_dump(), NamedToolChoice)
              if body.tool_choice is not None and not isinstance(body.tool_choice, str) else body.tool_choice)
    try:
        check_tools(tools, choice)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tool_choice" if str(exc).startswith("tool_choice") else "tools") from None
    choice = effective_choice(tools, choice)
    return ToolUse(tools, choice, body.parallel_tool_calls) if tools and choice != "none" else None


def output_constraint(body: SamplingFields, tools: ToolUse | None = None) -> StructuredOutputs | None:
    """The one constraint the request gives, validated (JSON schemas as canonical text); None if none."""
    given = [(param, spec) for param, spec in _sources(body, tools) if spec is not None]
    if len(given) > 1:
        names = " and ".join(param for param, _ in given)
        raise APIError(400, f"{names} both constrain the output; give one", param=given[0][0])
    if not given:
        return None
    param, spec = given[0]
    try:
        return spec.validate()
    except ValueError as exc:
        raise APIError(400, _named(str(exc), spec, param), param=param.split(".")[0]) from None


def _sources(body: SamplingFields, tools: ToolUse | None) -> list[tuple[str, StructuredOutputs | None]]:
    """(the field it came from, the constraint) for each way a request can constrain its output."""
    sources: list[tuple[str, StructuredOutputs | None]] = []
    if body.structured_outputs is not None:
        so = body.structured_outputs
        spec = StructuredOutputs(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                 json_object=bool(so.json_object))
        sources.append(("structured_outputs", _exactly_one(spec, "structured_outputs")))
    guided = [(f"guided_{kind}", StructuredOutputs(**{kind: value})) for kind, value in (
        ("json", body.guided_json), ("regex", body.guided_regex), ("choice", body.guided_choice),
        ("grammar", body.guided_grammar)) if value is not None]
    sources += guided
    if isinstance(body.response_format, JsonSchemaFormat):
        schema = body.response_format.json_schema.schema_
        if schema is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        sources.append(("response_format.json_schema.schema", StructuredOutputs(json=schema)))
    elif body.response_format is not None and body.response_format.type == "json_object":
        sources.append(("response_format", StructuredOutputs(json_object=True)))
    if tools is not None:
        try:
            sources.append(("tool_choice", tool_constraint(tools.tools, tools.choice, tools.parallel)))
        except ValueError as exc:  # a function's parameter schema cannot constrain the arguments
            raise APIError(400, str(exc), param="tools") from None
    return sources


def _exactly_one(spec: StructuredOutputs, param: str) -> StructuredOutputs:
    try:
        spec.kind()
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from None
    return spec


def _named(message: str, spec: StructuredOutputs, param: str) -> str:
    """validate() names vLLM's field (structured_outputs.json); say which field of this request it was."""
    if param == "structured_outputs":
        return message
    return message.replace(f"structured_outputs.{spec.kind()}", param)

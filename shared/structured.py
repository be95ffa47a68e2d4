"""Structured outputs: what a request's tokens must match (a JSON schema, any JSON object, a regex,
one of several strings, or a grammar), as it travels, and its llguidance grammar.

vLLM's `structured_outputs` names. Checked where requests enter (gateway, NATS tokenizer, `orca
generate`, the in-process engine), so a bad schema is the caller's error and never reaches an engine;
the engine's output rank compiles the same grammar text (model/structured.py). llguidance, not
xgrammar: both were measured here (benchmarks/README.md, "Structured outputs"), and llguidance checks a
grammar without a tokenizer and without importing torch, which the control plane must not.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import msgspec

JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False}
"""Compact JSON (`{"a":1}`, as OpenAI's models write it): free whitespace would let a model pad forever.
Not lenient: a keyword llguidance cannot enforce is an error, never silently ignored."""
MAX_SCHEMA_DEPTH = 100
"""Most levels of objects and arrays in a JSON schema. llguidance's JSON reader stops at about 125, and
Python's recursion limit (which torch raises when it compiles) at some depth of its own: which of them
refused a deeper schema, with which message, depended on the process. One limit below both: one message."""
TOO_DEEP = f"nested too deeply (more than {MAX_SCHEMA_DEPTH} levels of objects and arrays)"


class StructuredOutputs(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Exactly one field is set. `json` is a JSON schema, as an object or as JSON text."""

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    """A Lark grammar (llguidance's syntax) or a GBNF one (llama.cpp's, as vLLM's `grammar` takes)."""

    def kind(self) -> str:
        set_ = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            set_.append("json_object")
        if len(set_) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, json_object, regex, choice or grammar "
                             f"(got {', '.join(set_) or 'none'})")
        return set_[0]

    def normalized(self) -> StructuredOutputs:
        """The schema as compact JSON text, its keys in the order given (properties are written in that order)."""
        if self.json is not None and not isinstance(self.json, str):
            return msgspec.structs.replace(self, json=json.dumps(self.json, separators=(",", ":")))
        if self.choice is not None and not isinstance(self.choice, list):
            return msgspec.structs.replace(self, choice=list(self.choice))
        return self

    def validate(self) -> StructuredOutputs:
        """Normalized and checked; ValueError says what is wrong (never reaches an engine)."""
        grammar = self.grammar_text()
        spec = self.normalized()
        error = _grammar_error(grammar)
        if error:
            raise ValueError(f"invalid structured_outputs.{spec.kind()}: {error}")
        return spec

    def grammar_text(self) -> str:
        """The llguidance grammar (ValueError when the input cannot even be read)."""
        try:
            spec = self.normalized()
            return _grammar_text(spec.kind(), spec.json, spec.regex, tuple(spec.choice or ()), spec.grammar)
        except RecursionError:  # deeper than Python's stack, before the depth is counted (JSON text parses to any depth)
            raise ValueError(f"invalid structured_outputs.{self.kind()}: {TOO_DEEP}") from None


class JsonSchemaFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """OpenAI's `response_format`: text, json_object or json_schema."""

    type: str
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> StructuredOutputs | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            return StructuredOutputs(json=self.json_schema.schema)
        raise ValueError(f"response_format.type={self.type!r} must be text, json_object or json_schema")


def closed_objects(schema: Any) -> Any:
    """A copy of the schema in which an object that lists its properties and says nothing of others allows
    no others (OpenAI's strict mode, xgrammar's default): else a model may invent keys without end.
    An `allOf` is closed where its branches meet, on the object that holds it, which then allows the
    properties of every branch; each branch stays open (closed, one would forbid the other's keys: the
    usual `allOf: [{"$ref": "#/$defs/Base"}]` would be unsatisfiable)."""
    return _closed(schema, schema, frozenset())


_KEPT_AS_GIVEN = ("enum", "const", "default", "examples")


def _closed(node: Any, root: Any, inlining: frozenset[str], open_here: bool = False) -> Any:
    if isinstance(node, list):
        return [_closed(item, root, inlining) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _KEPT_AS_GIVEN:
            out[key] = value
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_closed(*_inlined(branch, root, inlining), open_here=True) for branch in value]
        else:
            out[key] = _closed(value, root, inlining)
    if open_here or "additionalProperties" in out or "unevaluatedProperties" in out:
        return out
    names = _property_names(out)
    if "properties" in out or names:
        own = out.get("properties") or {}
        out["properties"] = {name: own.get(name, {}) for name in names}
        out["additionalProperties"] = False
    return out


def _property_names(node: dict) -> list[str]:
    """The properties an object's allOf branches list (their own allOf too), then its own, in order."""
    names: dict[str, None] = {}
    for branch in node.get("allOf") or ():
        if isinstance(branch, dict):
            names.update(dict.fromkeys(_property_names(branch)))
    if isinstance(node.get("properties"), dict):
        names.update(dict.fromkeys(node["properties"]))
    return list(names)


def _inlined(branch: Any, root: Any, inlining: frozenset[str]) -> tuple[Any, Any, frozenset[str]]:
    """An allOf branch with its local `$ref` replaced by what it points to (the branch's own keys
    beside it kept), so that the branch can stay open where the definition elsewhere is closed. A ref
    already being inlined (a cycle) or not local stays a ref."""
    ref = branch.get("$ref") if isinstance(branch, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#") or ref in inlining:
        return branch, root, inlining
    target: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return branch, root, inlining  # llguidance reports the broken ref
        target = target[part]
    if not isinstance(target, dict):
        return branch, root, inlining
    rest = {key: value for key, value in branch.items() if key != "$ref"}
    return {**target, **rest} if rest else target, root, inlining | {ref}


@functools.lru_cache(maxsize=1024)
def _grammar_text(kind: str, schema: str | dict | None, regex: str | None, choice: tuple[str, ...],
                  grammar: str | None) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if kind == "json":
        try:
            parsed = json.loads(schema) if isinstance(schema, str) else schema
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid structured_outputs.json: not JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise ValueError("invalid structured_outputs.json: a JSON schema is an object")
        if nests_deeper_than(parsed, MAX_SCHEMA_DEPTH):
            raise ValueError(f"invalid structured_outputs.json: {TOO_DEEP}")
        try:
            return LLMatcher.grammar_from_json_schema(json.dumps(closed_objects(parsed)), defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise ValueError(f"invalid structured_outputs.json: {exc}") from None
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(regex or "")
    if kind == "choice":
        if not choice or not all(choice):
            raise ValueError("invalid structured_outputs.choice: give one or more non-empty strings")
        # One lexeme, not one rule of many alternatives: the lexer matches it, where a rule holds a parser
        # item per choice still possible, and llguidance allows 2,000 items at the most.
        return LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choice))
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(grammar or ""))
    except Exception as exc:  # noqa: BLE001 - the GBNF converter raises its own error types
        raise ValueError(f"invalid structured_outputs.grammar: {exc}") from None


@functools.lru_cache(maxsize=1024)
def _grammar_error(grammar: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar)


def nests_deeper_than(value: Any, levels: int) -> bool:
    """Whether `value` nests more than `levels` dicts and lists, counted level by level (no recursion)."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(levels):
        level = [child for container in level
                 for child in (container.values() if isinstance(container, dict) else container)
                 if isinstance(child, (dict, list))]
        if not level:
            return False
    return bool(level)

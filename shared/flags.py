"""The engine's command-line flags, generated from the config's own declarations (shared/config.py).

Every field of EngineConfig's sections carries a `Flag` (its help, and its names and choices where
they are not the field's own). From that, the field's type and its default, this module builds:

- `add_engine_args(parser, ...)`: the argparse flags, then the ORCA_<FIELD> variables as their
  defaults (shared/env.py), for `orca generate`, `orca serve`, `orca bench`, `orca simulate`, the
  engine service and the benchmark scripts alike;
- `engine_config_from_args(args)`: the EngineConfig a parse describes (`section_from_args`: one section);
- `engine_argv(config)`: the reverse, the flags that make a launched `orca serve` take that config;
- `add_serve_flags(parser, fields)` and `serve_config_from_args(args)`: the same for ServeConfig, how
  engines and services are run (replicas, timeouts, worker threads, queue bound), each launcher taking
  the flags of the fields it uses.

The type decides the flag: int, float and str take a value; `X | None` takes an X and defaults to
None; a bool that defaults to False is a switch (store_true); any other bool (True, or `bool | None`)
is `--x/--no-x` (BooleanOptionalAction). A field without a default (the model) is a required flag
unless a command gives it one.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from shared import env
from shared.config import ConfigField, EngineConfig, ServeConfig, engine_fields, serve_fields

SECTIONS: dict[str, type[msgspec.Struct]] = {f.name: f.type for f in msgspec.structs.fields(EngineConfig)}
"""EngineConfig's sections by attribute: model -> ModelConfig, scheduler -> SchedulerConfig, ..."""


def selected(names: Iterable[str] | None = None) -> list[ConfigField]:
    """The fields named (all when None), in declaration order; an unknown name is a ValueError."""
    every = engine_fields()
    if names is None:
        return every
    names = set(names)
    unknown = names - {f.name for f in every}
    if unknown:
        raise ValueError(f"no engine config field {sorted(unknown)}")
    return [f for f in every if f.name in names]


def value_type(f: ConfigField) -> type:
    """int for `int` and for `int | None`; a type argparse cannot parse is a TypeError."""
    if typing.get_origin(f.type) not in (None, typing.Union, types.UnionType):
        raise TypeError(f"{f.section}.{f.name}: no flag for a {f.type}")
    kinds = [t for t in typing.get_args(f.type) or (f.type,) if t is not type(None)]
    if len(kinds) != 1 or kinds[0] not in (int, float, str, bool):
        raise TypeError(f"{f.section}.{f.name}: no flag for a {f.type}")
    return kinds[0]


def is_switch(f: ConfigField) -> bool:
    """A plain bool that defaults to False: `--enable-x`, with no `--no-enable-x`."""
    return f.type is bool and f.default is False


def add_flags(container: argparse.ArgumentParser | argparse._ArgumentGroup, fields: Iterable[str] | None = None,
              defaults: Mapping[str, Any] | None = None, helps: Mapping[str, str] | None = None) -> list[str]:
    """Add the flags of `fields` (field names; all when None) to a parser or an argument group, without
    the ORCA_ variables; return their dests. `defaults` and `helps`, by field name: this command's own
    where they differ from the declaration's (a default for the model, None, makes --model optional)."""
    defaults, helps = defaults or {}, helps or {}
    selected([*defaults, *helps])  # a misspelt field is an error, not a silently unused default
    return _add_field_flags(container, selected(fields), defaults, helps)


def _add_field_flags(container: argparse.ArgumentParser | argparse._ArgumentGroup, chosen: list[ConfigField],
                     defaults: Mapping[str, Any], helps: Mapping[str, str]) -> list[str]:
    for f in chosen:
        default = defaults.get(f.name, f.default)
        kwargs: dict[str, Any] = {"help": helps.get(f.name, f.flag.help)}
        if value_type(f) is bool:
            kwargs["action"] = "store_true" if is_switch(f) else argparse.BooleanOptionalAction
        else:
            kwargs.update(type=value_type(f), choices=f.flag.choices)
        if default is msgspec.NODEFAULT:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        container.add_argument(*f.option_strings, **kwargs)
    return [f.dest for f in chosen]


def add_engine_args(parser: argparse.ArgumentParser, fields: Iterable[str] | None = None,
                    defaults: Mapping[str, Any] | None = None, helps: Mapping[str, str] | None = None,
                    title: str = "engine") -> None:
    """The engine flags of `fields` (all when None) as the argument group `title` (see `add_flags`),
    then their ORCA_<FIELD> variables as their defaults: a variable wins over `defaults`, a flag over both."""
    dests = add_flags(parser.add_argument_group(title), fields, defaults, helps)
    env.apply_engine_env(parser, dests=dests)  # ORCA_<FIELD> variables become these flags' defaults


def section_from_args(section: str, args: argparse.Namespace, fields: Iterable[str] | None = None,
                      **overrides: Any) -> msgspec.Struct:
    """One section of EngineConfig (`scheduler`: a SchedulerConfig) from a parse: each field of
    `fields` (all when None) that `args` has, a field in `overrides` from there, any other field its
    default. The section checks the values (ValueError)."""
    values = {f.name: getattr(args, f.dest) for f in selected(fields)
              if f.section == section and hasattr(args, f.dest)}
    return SECTIONS[section](**{**values, **overrides})


def engine_config_from_args(args: argparse.Namespace, fields: Iterable[str] | None = None,
                            **overrides: Any) -> EngineConfig:
    """The EngineConfig of a parse of `add_engine_args`' flags; `fields` and `overrides` (by field
    name) as for `section_from_args`. `fields` matters where args holds a same-named non-engine
    value (`orca bench --seed` seeds the workload, not the engine)."""
    by_section: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for f in selected(overrides):
        by_section[f.section][f.name] = overrides[f.name]
    return EngineConfig(**{section: section_from_args(section, args, fields, **by_section[section])
                           for section in SECTIONS})


def engine_argv(config: EngineConfig, environ: Mapping[str, str] | None = None) -> list[str]:
    """The flags that make a launched `orca serve` (or any `add_engine_args` parser) build `config`:
    one for each value that is not what the command would take anyway, the declared default or the
    ORCA_ variable `environ` sets (the child's environment; default this process's, which it inherits)."""
    inherited = env.engine_flag_defaults(environ)
    argv: list[str] = []
    for f in engine_fields():
        value, default = getattr(getattr(config, f.section), f.name), inherited.get(f.dest, f.default)
        if value == default:
            continue
        flag = f.option_strings[-1]  # the long name: --tensor-parallel-size, not -tp
        if value is None or (is_switch(f) and not value):
            raise ValueError(f"{flag}: no flag sets {value!r} over the launched command's default {default!r}")
        if value_type(f) is bool:
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
        else:
            argv += [flag, str(value)]
    return argv


def add_serve_flags(container: argparse.ArgumentParser | argparse._ArgumentGroup,
                    fields: Iterable[str] | None = None) -> None:
    """The flags of ServeConfig's `fields` (all when None): each launcher adds those it uses."""
    every = serve_fields()
    names = [f.name for f in every] if fields is None else list(fields)
    unknown = set(names) - {f.name for f in every}
    if unknown:
        raise ValueError(f"no serve config field {sorted(unknown)}")
    _add_field_flags(container, [f for f in every if f.name in names], {}, {})


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of a parse of `add_serve_flags`' flags: the fields the parser had, the rest
    their defaults. ServeConfig checks the values (ValueError)."""
    return ServeConfig(**{f.name: getattr(args, f.dest) for f in serve_fields() if hasattr(args, f.dest)})

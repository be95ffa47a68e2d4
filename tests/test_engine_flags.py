"""shared/flags.py: every engine config field has one flag and one ORCA_ variable, generated from its
declaration; a config survives being turned into flags (engine_argv) and parsed back, and every
command that takes engine flags spells them the same way."""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from loadtest.cli import BENCH_ENGINE_FIELDS, SIM_ENGINE_FIELDS, engine_config as bench_engine_config
from services.cli import build_parser, engine_config_from_args
from shared import env, flags
from shared.config import SCHEDULER_POLICIES, EngineConfig, ConfigField, Flag, ModelConfig, engine_fields

ROOT = Path(__file__).resolve().parents[1]
TODAYS_FLAGS = {"--model", "--dtype", "--device", "--max-model-len", "--seed", "--kernel-backend", "--enforce-eager",
                "--chat-template", "--scheduler", "--max-num-seqs", "--max-num-batched-tokens",
                "--enable-chunked-prefill", "--async-scheduling", "--kv-cache-tokens", "--block-size",
                "--enable-prefix-caching", "-tp", "--tensor-parallel-size", "-pp", "--pipeline-parallel-size"}
"""The engine flags before they were generated (vLLM's names): none may go or change."""
FREE_TEXT = {"model": lambda rng: f"/models/m{rng.randrange(100)}", "device": lambda rng: f"cuda:{rng.randrange(8)}",
             "chat_template": lambda rng: f"{{{{ messages[0]['content'] }}}} {rng.randrange(100)}"}
"""Values for the string fields without choices: only their sections' checks say what they accept."""


@pytest.fixture(autouse=True)
def no_engine_variables(monkeypatch):
    for var in env.engine_env_vars():
        monkeypatch.delenv(var.name, raising=False)


def other_value(f: ConfigField, rng: random.Random):
    """A value of the field's type, not its default, that its section accepts."""
    kind = flags.value_type(f)
    if f.flag.choices:
        return rng.choice([c for c in f.flag.choices if c != f.default])
    if kind is bool:
        return rng.choice([True, False]) if f.default is None else not f.default
    if kind is int:  # above the default keeps kv_cache_tokens >= block_size and every ">= 1" check
        return (f.default if isinstance(f.default, int) else 1) + rng.randint(1, 64)
    if kind is float:
        return (f.default or 0.0) + rng.uniform(0.5, 2.0)
    return FREE_TEXT[f.name](rng)


def random_config(rng: random.Random) -> EngineConfig:
    """The model and a random half of the other fields set to other values than their defaults."""
    values = {f.name: other_value(f, rng) for f in engine_fields()
              if f.default is msgspec.NODEFAULT or rng.random() < 0.5}
    return flags.engine_config_from_args(argparse.Namespace(), **values)


def value_of(config: EngineConfig, f: ConfigField):
    return getattr(getattr(config, f.section), f.name)


def test_every_field_has_one_flag_and_one_variable():
    declared = {(s.name, f.name) for s in msgspec.structs.fields(EngineConfig) for f in msgspec.structs.fields(s.type)}
    fields = engine_fields()
    assert {(f.section, f.name) for f in fields} == declared
    parser = argparse.ArgumentParser()
    flags.add_engine_args(parser)
    actions = {a.dest: a for a in parser._actions}
    variables = {v.field: v.name for v in env.engine_env_vars()}
    for f in fields:
        assert actions[f.dest].option_strings[:len(f.option_strings)] == list(f.option_strings)  # then --no-x
        assert actions[f.dest].help == f.flag.help
        assert variables[f.name] == "ORCA_" + f.dest.upper()
    names = [name for a in parser._actions for name in a.option_strings if a.dest != "help"]
    assert len(names) == len(set(names)) and TODAYS_FLAGS <= set(names)
    assert actions["scheduler"].choices == SCHEDULER_POLICIES and actions["tensor_parallel_size"].type is int


@pytest.mark.parametrize("seed", range(12))
def test_a_config_survives_its_flags(seed):
    config = random_config(random.Random(seed))
    argv = flags.engine_argv(config, environ={})
    for command in (["generate", "--input", "-", "--output", "-"], ["serve"]):
        assert engine_config_from_args(build_parser().parse_args([*command, *argv])) == config
    parser = argparse.ArgumentParser()
    flags.add_engine_args(parser)
    assert flags.engine_config_from_args(parser.parse_args(argv)) == config


@pytest.mark.parametrize("seed", range(6))
def test_a_config_survives_its_variables(seed, monkeypatch):
    config = random_config(random.Random(100 + seed))
    for var, f in zip(env.engine_env_vars(), engine_fields()):
        value = value_of(config, f)
        if value is not None:
            monkeypatch.setenv(var.name, str(value).lower() if isinstance(value, bool) else str(value))
    assert engine_config_from_args(build_parser().parse_args(["generate", "--input", "-", "--output", "-"])) == config


def test_engine_argv_gives_what_differs_from_the_launched_commands_defaults():
    config = EngineConfig(model=ModelConfig(model="m"))
    assert flags.engine_argv(config, environ={}) == ["--model", "m"]
    assert flags.engine_argv(config, environ={"ORCA_MAX_NUM_SEQS": "7"}) == ["--model", "m", "--max-num-seqs", "128"]
    seven = flags.engine_config_from_args(argparse.Namespace(), model="m", max_num_seqs=7, async_scheduling=False,
                                          tensor_parallel_size=2, enforce_eager=True)
    assert flags.engine_argv(seven, environ={"ORCA_MAX_NUM_SEQS": "7"}) == [
        "--model", "m", "--enforce-eager", "--no-async-scheduling", "--tensor-parallel-size", "2"]
    with pytest.raises(ValueError, match="--enable-prefix-caching"):  # a switch has no --no- form to undo a variable
        flags.engine_argv(config, environ={"ORCA_ENABLE_PREFIX_CACHING": "true"})


@pytest.mark.parametrize("via", ["flags", "variables"])
def test_a_new_setting_reaches_every_entry_point_from_its_one_declaration(via, monkeypatch, tmp_path):
    """long_prefill_token_threshold is one field in shared/config.py: `orca generate`, `orca serve`,
    `orca bench --launch` and `orca simulate` take it as a flag or as ORCA_LONG_PREFILL_TOKEN_THRESHOLD,
    and the server `orca bench --launch` starts gets it in its argv."""
    argv = ["--enable-chunked-prefill", "--long-prefill-token-threshold", "8"]
    if via == "variables":
        argv = []
        monkeypatch.setenv("ORCA_ENABLE_CHUNKED_PREFILL", "true")
        monkeypatch.setenv("ORCA_LONG_PREFILL_TOKEN_THRESHOLD", "8")
    parser = build_parser()
    commands = {"generate": ["--model", "m", "--input", "-", "--output", "-"], "serve": [], "bench": ["--launch"],
                "simulate": []}
    for name, rest in commands.items():
        args = parser.parse_args([name, *rest, *argv])
        scheduler = flags.section_from_args("scheduler", args)
        assert (scheduler.enable_chunked_prefill, scheduler.long_prefill_token_threshold) == (True, 8), name
    launched = bench_engine_config(parser.parse_args(["bench", "--launch", "--model", str(tmp_path), *argv]), "orca")
    served = flags.engine_argv(launched, environ={})  # the child's environment without the variables
    assert served[served.index("--long-prefill-token-threshold") + 1] == "8"
    assert engine_config_from_args(parser.parse_args(["serve", *served])) == launched


def test_a_field_type_without_a_flag_shape_is_refused():
    with pytest.raises(TypeError, match="no flag"):
        flags.value_type(ConfigField("cache", "sizes", list[int], msgspec.NODEFAULT, Flag("sizes")))
    with pytest.raises(ValueError, match="no engine config field"):
        flags.selected(["max_num_seq"])


def test_every_command_spells_the_engine_flags_alike():
    commands = build_parser()._subparsers._group_actions[0].choices
    generate = {a.dest: a for a in commands["generate"]._actions}
    every = [f.name for f in engine_fields()]
    for name, fields in {"generate": every, "serve": every, "bench": BENCH_ENGINE_FIELDS,
                         "simulate": SIM_ENGINE_FIELDS}.items():
        actions = {a.dest: a for a in commands[name]._actions}
        for f in flags.selected(fields):
            a, reference = actions[f.dest], generate[f.dest]
            assert (a.option_strings, type(a), a.type, a.choices) == (
                reference.option_strings, type(reference), reference.type, reference.choices), (name, f.name)
        if name in ("bench", "simulate"):
            assert "scheduler" not in actions  # --policy names the policies there
    assert set(SIM_ENGINE_FIELDS) == {f.name for f in engine_fields()
                                      if f.section in ("scheduler", "cache")} - {"policy"}


def test_readme_tables_name_every_flag_and_variable():
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `(ORCA_[A-Z_]+)` \| `(-[a-z-]+)` \| `(\w+\.\w+)` \|$", readme, flags=re.M)
    assert len(rows) == len(set(rows)) and set(rows) == {(v.name, f.option_strings[0], f"{f.section}.{f.name}")
                                                         for v, f in zip(env.engine_env_vars(), engine_fields())}
    offline = readme[readme.index("Engine flags (same names as vLLM's"):readme.index("## The model step")]
    listed = set(re.findall(r"`(-[-a-z]+)", offline))
    assert all(set(f.option_strings) & listed for f in engine_fields()), sorted(
        f.option_strings[-1] for f in engine_fields() if not set(f.option_strings) & listed)


def test_the_flags_module_imports_no_torch():
    code = "import sys, shared.flags; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"

"""shared/env.py: ORCA_<FIELD> for every engine config field, as the defaults of the same flags in
every way of running; the README's deployment table lists exactly the variables read."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from services.cli import build_parser, engine_config_from_args
from shared import env
from shared.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]


def test_every_engine_config_field_has_a_variable():
    fields = {(section, f.name) for section, struct in
              [("model", ModelConfig), ("scheduler", SchedulerConfig), ("cache", CacheConfig),
               ("parallel", ParallelConfig)] for f in msgspec.structs.fields(struct)}
    variables = env.engine_env_vars()
    assert {(v.section, v.field) for v in variables} == fields
    names = [v.name for v in variables]
    assert len(names) == len(set(names))
    assert "ORCA_MAX_NUM_SEQS" in names and "ORCA_SCHEDULER" in names and "ORCA_TENSOR_PARALLEL_SIZE" in names


def test_every_variable_defaults_a_flag_of_orca_serve():
    """Each variable's dest is a flag of add_engine_args, so none is silently ignored."""
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    dests = {a.dest for a in serve._actions}
    assert {v.dest for v in env.engine_env_vars()} <= dests


def parse(argv: list[str]):
    return engine_config_from_args(build_parser().parse_args(argv))


def test_variables_become_the_engine_config(monkeypatch, tmp_path):
    for name, value in {"ORCA_MODEL": str(tmp_path), "ORCA_SCHEDULER": "paged", "ORCA_MAX_NUM_SEQS": "7",
                        "ORCA_MAX_NUM_BATCHED_TOKENS": "512", "ORCA_ENABLE_CHUNKED_PREFILL": "true",
                        "ORCA_KV_CACHE_TOKENS": "4096", "ORCA_BLOCK_SIZE": "1", "ORCA_ENABLE_PREFIX_CACHING": "1",
                        "ORCA_DTYPE": "float64", "ORCA_DEVICE": "cuda:1", "ORCA_MAX_MODEL_LEN": "256",
                        "ORCA_SEED": "5", "ORCA_KERNEL_BACKEND": "torch", "ORCA_PIPELINE_PARALLEL_SIZE": "2",
                        "ORCA_TENSOR_PARALLEL_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    config = parse(["generate", "--input", "-", "--output", "-"])  # --model from ORCA_MODEL
    assert config.model == ModelConfig(model=str(tmp_path), dtype="float64", device="cuda:1", max_model_len=256,
                                       seed=5, kernel_backend="torch")
    assert config.scheduler == SchedulerConfig(policy="paged", max_num_seqs=7, max_num_batched_tokens=512,
                                               enable_chunked_prefill=True)
    assert config.cache == CacheConfig(kv_cache_tokens=4096, block_size=1, enable_prefix_caching=True)
    assert config.parallel == ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)


def test_a_flag_beats_its_variable_and_empty_means_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("ORCA_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("ORCA_BLOCK_SIZE", "")
    config = parse(["generate", "--model", str(tmp_path), "--input", "-", "--output", "-", "--max-num-seqs", "3"])
    assert config.scheduler.max_num_seqs == 3 and config.cache.block_size == CacheConfig().block_size


def test_without_variables_the_defaults_are_the_configs(monkeypatch, tmp_path):
    for var in env.engine_env_vars():
        monkeypatch.delenv(var.name, raising=False)
    config = parse(["generate", "--model", str(tmp_path), "--input", "-", "--output", "-"])
    assert (config.scheduler, config.cache, config.parallel) == (SchedulerConfig(), CacheConfig(), ParallelConfig())
    with pytest.raises(SystemExit):  # --model stays required
        build_parser().parse_args(["generate", "--input", "-", "--output", "-"])


def test_a_bad_value_names_the_variable(monkeypatch, capsys):
    assert env.engine_flag_defaults({"ORCA_MAX_NUM_SEQS": "8"}) == {"max_num_seqs": 8}
    with pytest.raises(ValueError, match="ORCA_MAX_NUM_SEQS='many'"):
        env.engine_flag_defaults({"ORCA_MAX_NUM_SEQS": "many"})
    with pytest.raises(ValueError, match="ORCA_ENABLE_PREFIX_CACHING"):
        env.engine_flag_defaults({"ORCA_ENABLE_PREFIX_CACHING": "maybe"})
    monkeypatch.setenv("ORCA_KV_CACHE_TOKENS", "lots")
    parser = build_parser()  # only the command that runs says so, after its --help had its turn
    for command in (["serve", "--port", "0"], ["generate", "--model", "m", "--input", "-", "--output", "-"]):
        with pytest.raises(SystemExit):
            parser.parse_args(command)
        err = capsys.readouterr().err
        assert err.splitlines()[-1] == f"orca {command[0]}: error: ORCA_KV_CACHE_TOKENS='lots': Expected `int`, got `str`"
    with pytest.raises(SystemExit) as helped:
        build_parser().parse_args(["serve", "--help"])
    assert helped.value.code == 0 and "--kv-cache-tokens" in capsys.readouterr().out
    monkeypatch.setenv("ORCA_KV_CACHE_TOKENS", "8")
    monkeypatch.setenv("ORCA_SCHEDULER", "lifo")  # right type, wrong value: the config's own check
    with pytest.raises(ValueError, match="lifo"):
        parse(["generate", "--model", "m", "--input", "-", "--output", "-"])


def test_nats_credentials(monkeypatch):
    monkeypatch.delenv("ORCA_NATS_USER", raising=False)
    monkeypatch.setenv("ORCA_NATS_PASSWORD", "secret")
    assert env.nats_credentials() is None
    monkeypatch.setenv("ORCA_NATS_USER", "tokenizer")
    assert env.nats_credentials() == ("tokenizer", "secret")
    monkeypatch.delenv("ORCA_NATS_PASSWORD")
    monkeypatch.setenv("ORCA_NATS_GATEWAY_PASSWORD", "g")
    monkeypatch.setenv("ORCA_NATS_TOKENIZER_PASSWORD", "t")
    assert env.nats_credentials() == ("tokenizer", "t")


def test_readme_lists_exactly_the_variables_read():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Deployment"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    listed = set(re.findall(r"^\| `(ORCA_[A-Z_]+)`", section, flags=re.M))
    expected = {v.name for v in env.engine_env_vars()} | set(env.SERVICE_ENV_VARS)
    assert expected <= listed, sorted(expected - listed)
    others = listed - expected  # read elsewhere (telemetry) or by the NATS server: must be real names
    code = "".join(p.read_text() for p in [*ROOT.glob("shared/*.py"), *ROOT.glob("deploy/nats/*.conf")])
    assert all(name in code for name in others), sorted(n for n in others if n not in code)

"""The launch settings (shared/config.py ServeConfig) are declared once: `orca serve` takes every one
as a flag, each service and the engine replica take the flags of the ones they use, the values reach
the commands `orca serve` starts, and a bad value is one clear error before anything starts."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from services import serve
from services.cli import build_parser, engine_config_from_args
from services.engine.launch import REPLICA_SETTINGS, WorkerLaunch, replica_parser
from services.jobs.__main__ import parse_args as jobs_args
from shared.config import ServeConfig, serve_fields
from shared.flags import add_serve_flags, serve_config_from_args

ROOT = Path(__file__).resolve().parents[1]
OTHER = {"replicas": 3, "worker_threads": 2, "worker_cpus": 0.5, "step_timeout": 7.5, "hang_timeout": 4.0,
         "drain_timeout": 0.0, "max_queue_len": 9, "startup_timeout": 60.0, "jobs_ack_wait": 4.5}
"""A value for every field, none its default."""


def argv_of(values: dict) -> list[str]:
    return [arg for name, value in values.items() for arg in ("--" + name.replace("_", "-"), str(value))]


def test_every_field_is_set_by_a_flag_of_orca_serve_and_defaults_to_its_declaration():
    assert set(OTHER) == {f.name for f in serve_fields()}
    assert all(OTHER[f.name] != f.default for f in serve_fields())
    defaults = serve_config_from_args(build_parser().parse_args(["serve"]))
    assert defaults == ServeConfig()
    parsed = serve_config_from_args(build_parser().parse_args(["serve", *argv_of(OTHER)]))
    assert msgspec.structs.asdict(parsed) == OTHER


def test_the_engine_replica_takes_its_settings_and_the_rayservice_parses_them_the_same_way():
    mine = {name: OTHER[name] for name in REPLICA_SETTINGS}
    args = replica_parser("engine").parse_args(["--model", "/m", *argv_of(mine)])
    settings = serve_config_from_args(args)
    assert {name: getattr(settings, name) for name in REPLICA_SETTINGS} == mine
    launch = WorkerLaunch.of(settings)
    assert (launch.step_timeout_s, launch.worker_cpus, launch.worker_threads) == (7.5, 0.5, 2)
    with pytest.raises(SystemExit):  # not an engine replica's setting
        replica_parser("engine").parse_args(["--model", "/m", "--max-queue-len", "3"])


def test_orca_serve_hands_its_settings_to_the_services_it_starts(tmp_path, monkeypatch):
    started = {}

    class Recorder:
        def __init__(self, name, command, *args, hang_timeout_s, **kwargs):
            started[name] = (command([]), hang_timeout_s)

        def start(self, now):
            return self

    monkeypatch.setattr(serve, "SupervisedProcess", Recorder)
    parsed = build_parser().parse_args(["serve", "--model", str(tmp_path), *argv_of(OTHER)])
    serve.start_services(serve_config_from_args(parsed), "nats://x", engine_config_from_args(parsed), tmp_path)
    for name in ("tokenizer", "jobs"):
        command, hang = started[name]
        assert command[command.index("--drain-timeout") + 1] == "0.0" and hang == 4.0
    jobs = jobs_args(started["jobs"][0][3:])  # the jobs service parses what it gets
    assert (jobs.drain_timeout, jobs.jobs_ack_wait) == (0.0, 4.5)
    admission = started["admission"][0]
    assert admission[admission.index("--max-queue-len") + 1] == "9"


@pytest.mark.parametrize("name,value", [("replicas", "0"), ("worker_threads", "0"), ("step_timeout", "0"),
                                        ("hang_timeout", "-1"), ("drain_timeout", "-1"), ("max_queue_len", "0"),
                                        ("worker_cpus", "0"), ("startup_timeout", "0"),
                                        ("jobs_ack_wait", "0")])
def test_a_bad_value_is_a_value_error_naming_the_field(name, value):
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    with pytest.raises(ValueError, match=name):
        serve_config_from_args(parser.parse_args(["--" + name.replace("_", "-"), value]))


def test_orca_serve_refuses_a_bad_setting_in_one_line_before_starting_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(tmp_path), "--replicas", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["orca: error: replicas=0 must be >= 1"]


def test_an_unknown_field_is_refused():
    with pytest.raises(ValueError, match="no serve config field"):
        add_serve_flags(argparse.ArgumentParser(), ["drain_timeout_s"])


@pytest.mark.parametrize("port,words", [("80000", "80000 is not a port (0-65535"), ("-1", "-1 is not a port"),
                                        ("http", "'http' is not a port number")])
def test_a_port_out_of_range_is_a_usage_error_not_a_traceback(port, words, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["serve", "--model", "m", "--port", port])
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def test_port_zero_and_the_top_port_are_ports():
    for port in ("0", "65535"):
        assert build_parser().parse_args(["serve", "--model", "m", "--port", port]).port == int(port)


def test_a_ray_address_nothing_answers_at_is_one_line_at_once(demo_model):
    """Ray's own connect waited for a GCS there for minutes (and --ray-address auto with no Ray printed
    Ray's traceback: the same one line now, services/serve.py)."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once it is closed
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", demo_model,
                          "--ray-address", f"127.0.0.1:{port}", "--port", "0"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert f"orca: error: --ray-address 127.0.0.1:{port}: no Ray cluster answers there" in run.stderr, run.stderr
    assert time.monotonic() - began < 30


@pytest.mark.parametrize("address", [None, "auto", "ray://head:10001", "head"])
def test_addresses_left_to_ray_are_not_checked_here(address):
    serve.check_ray_address_answers(address)


def test_a_ray_address_that_is_no_address_is_refused():
    with pytest.raises(ValueError, match="not host:port, auto or ray://"):
        serve.check_ray_address_answers("head:port")

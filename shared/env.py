"""The one place that reads environment variables.

Engine settings: every field of the engine config's sections (`shared/config.py`) can be set as
`ORCA_<FIELD>` (`ORCA_MAX_NUM_SEQS=64`, `ORCA_ENABLE_PREFIX_CACHING=true`). The table is derived
from the structs' fields, so a new field gets its variable without an edit here. The variables
become the defaults of the matching command-line flags (`apply_engine_env`), so an explicit flag
still wins, and `orca serve`, `python -m services.<name>`, compose and Kubernetes all read the same
names the same way. A variable is named after its flag: the one field whose flag has another name
is `SchedulerConfig.policy`, whose flag is vLLM's `--scheduler` (declared with the field), and so
the variable is `ORCA_SCHEDULER`.

Service settings (NATS address and credentials, API key, ...) are the functions below,
listed with their meaning in `SERVICE_ENV_VARS`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from shared.config import engine_fields

PREFIX = "ORCA_"

SERVICE_ENV_VARS: dict[str, str] = {
    "ORCA_NATS_URL": "NATS server URL, or a cluster's URLs comma-separated (`--nats-url` default of `orca serve` and every service)",
    "ORCA_JETSTREAM_REPLICAS": "copies of the jobs streams (`--jetstream-replicas` of the jobs service): 3 on a NATS cluster, default 1",
    "ORCA_NATS_USER": "NATS user this process connects as (one per service: deploy/nats/nats.conf)",
    "ORCA_NATS_PASSWORD": "that user's password (never logged); unset: ORCA_NATS_<USER>_PASSWORD",
    "ORCA_API_KEY": "bearer token the HTTP gateway requires (unset: no auth)",
    "ORCA_ALLOWED_ORIGINS": "origins browsers may call the HTTP API from, comma-separated (CORS; unset: `*`, as vLLM; empty: none)",
    "ORCA_CACHE_DIR": "where `orca serve` makes the demo model (default ~/.cache/orca-serve)",
    "ORCA_TEST_FAULT_FILE": "tests only: a file there makes a worker's next step fail (`raise`) or hang (`hang <s>`)",
}
"""The service settings read here, with what each means (the README's table lists the same)."""


@dataclass(frozen=True)
class EngineEnvVar:
    name: str
    """The variable, e.g. ORCA_MAX_NUM_SEQS."""
    section: str
    """EngineConfig's attribute holding the field: model, scheduler, cache or parallel."""
    field: str
    dest: str
    """The argparse dest of the flag it defaults (`shared/flags.py` add_engine_args)."""
    type: Any


def engine_env_vars() -> list[EngineEnvVar]:
    """ORCA_<FIELD> for every field of every engine config section, in declaration order."""
    return [EngineEnvVar(PREFIX + f.dest.upper(), f.section, f.name, f.dest, f.type) for f in engine_fields()]


def engine_flag_defaults(environ: Mapping[str, str] | None = None,
                         dests: Collection[str] | None = None) -> dict[str, Any]:
    """{argparse dest: value} for each engine variable that is set and not empty (of the flags
    `dests` only, if given), converted to the field's type; a value that does not convert is a
    ValueError naming the variable."""
    environ = os.environ if environ is None else environ
    defaults = {}
    for var in engine_env_vars():
        raw = environ.get(var.name, "")
        if raw == "" or (dests is not None and var.dest not in dests):
            continue
        try:
            defaults[var.dest] = msgspec.convert(raw, var.type, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{var.name}={raw!r}: {exc}") from None
    return defaults


def apply_engine_env(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None,
                     dests: Collection[str] | None = None) -> None:
    """Make the engine variables the defaults of `parser`'s flags; a required flag whose variable
    is set (ORCA_MODEL) is no longer required. Call after the flags are added. A bad value
    exits as a usage error does, naming the variable, when `parser` parses: a subcommand's parser
    only when that subcommand is run, and after its --help had its turn. `dests`: only these flags'
    variables (a parser whose own --seed means something else, as `orca bench`'s, takes no ORCA_SEED)."""
    try:
        defaults = engine_flag_defaults(environ, dests)
    except ValueError as exc:
        _fail_when_parsing(parser, str(exc))
        return
    parser.set_defaults(**defaults)
    for action in parser._actions:  # argparse has no public way to relax `required`
        if action.dest in defaults:
            action.required = False


def _fail_when_parsing(parser: argparse.ArgumentParser, message: str) -> None:
    parse = parser.parse_known_args  # what argparse calls on a subcommand's parser, and parse_args on any

    def parse_then_fail(*args: Any, **kwargs: Any):
        parse(*args, **kwargs)  # --help exits in here, as it would with a good value
        parser.error(message)

    parser.parse_known_args = parse_then_fail  # type: ignore[method-assign]


def prefer_passive_openmp() -> None:
    """Make OpenMP threads sleep, not spin, while they wait (unless OMP_WAIT_POLICY is set). Call before
    torch is imported. On a small machine the model's threads share cores with the control plane or
    other work; spinning threads then hold a core while waiting at every op's barrier for a descheduled
    sibling. Measured on this 2-core VM under load (benchmarks/README.md): 2 threads at the default
    policy 35 generated tok/s, passive 940."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def cache_dir() -> Path:
    """Where `orca serve` keeps the demo model it makes on first run."""
    explicit = os.environ.get("ORCA_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "orca-serve"


def nats_url_default() -> str | None:
    return os.environ.get("ORCA_NATS_URL") or None


def nats_credentials() -> tuple[str, str] | None:
    """(user, password) from ORCA_NATS_USER and ORCA_NATS_PASSWORD, or None when no user is set.
    Without ORCA_NATS_PASSWORD the password is ORCA_NATS_<USER>_PASSWORD: a Ray pod that hosts
    several services holds every password and each actor names only its user (deploy/k8s)."""
    user = os.environ.get("ORCA_NATS_USER") or None
    if user is None:
        return None
    password = os.environ.get("ORCA_NATS_PASSWORD") or os.environ.get(f"ORCA_NATS_{user.upper()}_PASSWORD", "")
    return user, password


def jetstream_replicas() -> str | None:
    """ORCA_JETSTREAM_REPLICAS: the jobs service's `--jetstream-replicas` default (checked there)."""
    return os.environ.get("ORCA_JETSTREAM_REPLICAS") or None


def api_key() -> str | None:
    """ORCA_API_KEY: the bearer token the HTTP gateway requires (unset or empty: no auth)."""
    return os.environ.get("ORCA_API_KEY") or None


def allowed_origins() -> tuple[str, ...]:
    """ORCA_ALLOWED_ORIGINS: the origins a browser may call the HTTP API from (CORS); unset: every origin,
    as vLLM's --allowed-origins default; empty: none (no CORS headers)."""
    value = os.environ.get("ORCA_ALLOWED_ORIGINS")
    if value is None:
        return ("*",)
    return tuple(origin.strip() for origin in value.split(",") if origin.strip())


def fault_injection_file() -> Path | None:
    """ORCA_TEST_FAULT_FILE (tests only): a path workers look at before each step; a file there
    makes one step fail ("raise") or hang ("hang <seconds>"), and is removed when it fires."""
    path = os.environ.get("ORCA_TEST_FAULT_FILE")
    return Path(path) if path else None

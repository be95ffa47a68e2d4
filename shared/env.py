"""The one place that reads environment variables."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where `orca serve` keeps the demo model it makes on first run."""
    explicit = os.environ.get("ORCA_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "orca-serve"


def nats_url_default() -> str | None:
    return os.environ.get("ORCA_NATS_URL") or None


def api_key() -> str | None:
    """ORCA_API_KEY: the bearer token the HTTP gateway requires (unset or empty: no auth)."""
    return os.environ.get("ORCA_API_KEY") or None

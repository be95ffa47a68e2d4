"""CORS, as vLLM's defaults have it (every origin): a browser's preflight is answered without the API key,
and the answers carry Access-Control-Allow-Origin; ORCA_ALLOWED_ORIGINS narrows it, or turns it off."""

from __future__ import annotations

from collections import Counter

import pytest
from fastapi.testclient import TestClient

from services.gateway.app import build_app
from services.gateway.state import GatewaySettings, GatewayState
from tests.gateway.fakes import VOCAB, FakeEngineClient, FakeTokenizer

PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def gateway(monkeypatch, origins: str | None) -> TestClient:
    if origins is None:
        monkeypatch.delenv("ORCA_ALLOWED_ORIGINS", raising=False)
    else:
        monkeypatch.setenv("ORCA_ALLOWED_ORIGINS", origins)
    settings = GatewaySettings(nats_url="nats://unused", model="m", api_key="sk-test")
    app = build_app(settings)
    app.state.gateway = GatewayState(settings, FakeEngineClient(lambda r: ["ok"]), FakeTokenizer(), VOCAB, 512,
                                     Counter())
    return TestClient(app)


def test_every_origin_by_default_and_the_preflight_needs_no_key(monkeypatch):
    http = gateway(monkeypatch, None)
    preflight = http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    answer = http.post("/v1/completions", json={"prompt": "hi"},
                       headers={"Origin": "https://app.example", "Authorization": "Bearer sk-test"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
    assert http.post("/v1/completions", json={"prompt": "hi"}, headers={"Origin": "https://x"}).status_code == 401


@pytest.mark.parametrize("origins,allowed", [("https://app.example", True), ("https://other.example", False),
                                             ("", None)])
def test_allowed_origins_narrow_it_or_turn_it_off(monkeypatch, origins, allowed):
    preflight = gateway(monkeypatch, origins).options("/v1/chat/completions", headers=PREFLIGHT)
    if allowed is None:  # no CORS at all: the route answers OPTIONS itself (auth first)
        assert "access-control-allow-origin" not in preflight.headers
    else:
        assert (preflight.headers.get("access-control-allow-origin") == "https://app.example") is allowed


def test_version_is_the_installed_packages_and_needs_the_key(monkeypatch):
    """vLLM's GET /version, with orca-serve's version; like every route but /health and /metrics, behind the key."""
    import importlib.metadata

    http = gateway(monkeypatch, None)
    assert http.get("/version").status_code == 401
    answer = http.get("/version", headers={"Authorization": "Bearer sk-test"})
    assert answer.status_code == 200 and answer.json() == {"version": importlib.metadata.version("orca-serve")}

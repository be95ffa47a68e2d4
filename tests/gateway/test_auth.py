"""The gateway alone (`python -m services.gateway`, uvicorn, no Ray) against a running stack's
NATS, with the API key from ORCA_API_KEY: every route but /health and /metrics wants it."""

from __future__ import annotations

import signal

import httpx
import pytest

from services.gateway.app import build_app
from services.gateway.state import GatewaySettings
from tests.gateway.helpers import GatewayProcess

pytestmark = pytest.mark.slow

KEY = "sk-test-0123456789abcdef"
PUBLIC = {"/health", "/metrics"}


@pytest.fixture(scope="module")
def standalone(gateway, demo_model):
    process = GatewayProcess(gateway.nats_url, demo_model, "--served-model-name", "alone",
                             env={"ORCA_API_KEY": KEY})
    yield process
    assert process.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the SIGTERM it handled
    assert not any(KEY in line for line in process.log), "the API key must never be logged"


def every_route(demo_model: str) -> list[tuple[str, str]]:
    """(method, path) of every route the app has, the docs included, path parameters filled in."""
    app = build_app(GatewaySettings(nats_url="nats://unused", model=demo_model))
    out = []
    for route in app.routes:
        path = route.path.replace("{model_id:path}", "alone").replace("{request_id}", "cmpl-x")
        out += [(method, path) for method in sorted(route.methods - {"HEAD"})]
    return out


def test_every_route_but_health_and_metrics_needs_the_key(standalone, demo_model):
    routes = every_route(demo_model)
    assert len(routes) >= 12
    good = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=standalone.http_url, timeout=30) as http:
        for method, path in routes + [("GET", "/no-such-route")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                response = http.request(method, path, headers=headers, json={} if method == "POST" else None)
                if path in PUBLIC:
                    assert response.status_code == 200, (method, path)
                else:
                    assert response.status_code == 401, (method, path, headers)
                    assert response.json()["error"]["code"] == "invalid_api_key"
                    assert response.headers["www-authenticate"] == "Bearer"
            response = http.request(method, path, headers=good, json={} if method == "POST" else None)
            assert response.status_code != 401 and response.status_code < 500, (method, path, response.text)


def test_the_standalone_gateway_serves(standalone):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=standalone.http_url, timeout=60, headers=headers) as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == "alone"
        out = http.post("/v1/completions", json={"model": "alone", "prompt": "def f():", "max_tokens": 4}).json()
        assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "length"

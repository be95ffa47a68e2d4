"""`orca serve` deploys the gateway on a thread while its engines start (services/serve.py
GatewayStart): the URL comes back once the deployment is done, and a deployment that failed fails
`orca serve` with its own error, not a hang or a later, vaguer one."""

from __future__ import annotations

import argparse
import threading

import pytest

from services import serve


def test_the_gateway_starts_beside_the_caller_and_hands_back_its_url(monkeypatch):
    release, on_thread = threading.Event(), {}

    def start_gateway(args, nats_url, config):
        on_thread["name"] = threading.current_thread().name
        release.wait(5)
        return f"http://{args.host}:{args.port}"

    monkeypatch.setattr(serve, "start_gateway", start_gateway)
    start = serve.GatewayStart(argparse.Namespace(host="127.0.0.1", port=8123), "nats://x", None).begin()
    start.join(0.05)  # still deploying: the caller goes on meanwhile
    release.set()
    assert start.result() == "http://127.0.0.1:8123"
    assert on_thread["name"] == "gateway-start"


def test_a_failed_deployment_raises_its_own_error_in_the_caller(monkeypatch):
    def start_gateway(args, nats_url, config):
        raise ValueError("--host 10.9.9.9 --port 80: cannot listen there")

    monkeypatch.setattr(serve, "start_gateway", start_gateway)
    start = serve.GatewayStart(argparse.Namespace(), "nats://x", None).begin()
    with pytest.raises(ValueError, match="cannot listen there"):
        start.result()

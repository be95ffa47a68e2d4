"""services/bus.py: a --nats-url / ORCA_NATS_URL value may be one server or a cluster's list
(`nats://a:4222,nats://b:4222`): each becomes nats.py's `servers`, the credentials the list's
(or the environment's), passwords redacted in logs; and a connection made that way reaches a real
cluster through a server that is down."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services import bus
from services.nats_server import LocalNatsServer, free_port


@pytest.fixture(autouse=True)
def no_credentials_from_the_environment(monkeypatch):
    for name in ("ORCA_NATS_USER", "ORCA_NATS_PASSWORD"):
        monkeypatch.delenv(name, raising=False)


def test_a_single_url_is_a_list_of_one():
    assert bus.server_urls("nats://127.0.0.1:4222") == ["nats://127.0.0.1:4222"]
    assert bus.auth_options("nats://127.0.0.1:4222") == {}


def test_a_comma_separated_list_is_every_server_in_order():
    urls = "nats://nats-1:4222, nats://nats-2:4222 ,tls://nats-3:4443,nats-4:4222,nats://[::1]:4222"
    assert bus.server_urls(urls) == ["nats://nats-1:4222", "nats://nats-2:4222", "tls://nats-3:4443",
                                     "nats://nats-4:4222", "nats://[::1]:4222"]


@pytest.mark.parametrize("url,problem", [
    ("", "no server"), (" , ", "no server"), ("nats://a:4222,,nats://b:4222", "empty entry"),
    ("nats://a:4222,", "empty entry"), ("nats://a:port", "not a number"), ("http://a:4222", "want nats://"),
    ("nats://:4222", "want nats://"),
])
def test_a_bad_list_is_a_value_error_that_says_why(url, problem):
    with pytest.raises(ValueError, match=problem):
        bus.server_urls(url)


def test_credentials_in_the_urls_become_options_for_every_server():
    """Given as options they reach the servers nats.py learns from the cluster too (those come without
    any), and a server named without them gets the same ones."""
    urls = "nats://jobs:s3cret@nats-1:4222,nats://nats-2:4222,nats://jobs:s3cret@nats-3:4222"
    assert bus.server_urls(urls) == ["nats://nats-1:4222", "nats://nats-2:4222", "nats://nats-3:4222"]
    assert bus.auth_options(urls) == {"user": "jobs", "password": "s3cret", "inbox_prefix": "_INBOX_jobs"}
    assert bus.auth_options("nats://t0ken@nats-1:4222,nats://nats-2:4222") == {"token": "t0ken"}


def test_servers_naming_different_users_are_refused():
    with pytest.raises(ValueError, match="different credentials") as error:
        bus.auth_options("nats://jobs:one@a:4222,nats://engine:two@b:4222")
    assert "one" not in str(error.value) and "two" not in str(error.value)


def test_without_credentials_in_the_urls_the_environment_gives_them(monkeypatch):
    monkeypatch.setenv("ORCA_NATS_USER", "tokenizer")
    monkeypatch.setenv("ORCA_NATS_PASSWORD", "pw")
    expected = {"user": "tokenizer", "password": "pw", "inbox_prefix": "_INBOX_tokenizer"}
    assert bus.auth_options("nats://a:4222,nats://b:4222") == expected
    assert bus.auth_options("nats://admission:own@a:4222")["user"] == "admission"  # the URL's own win


def test_redact_url_hides_every_password_of_a_list():
    urls = "nats://jobs:s3cret@nats-1:4222,nats://nats-2:4222,nats://t0ken@nats-3:4222,jobs:s3cret@nats-4:4222"
    redacted = bus.redact_url(urls)
    assert redacted == ("nats://jobs:***@nats-1:4222,nats://nats-2:4222,nats://***@nats-3:4222,"
                        "nats://jobs:***@nats-4:4222")
    assert "s3cret" not in redacted and "t0ken" not in redacted
    assert bus.redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


def test_connect_reaches_a_listed_server_when_another_is_down():
    """nats.py picks the servers in random order: with a dead one listed first or not, it connects."""
    server = LocalNatsServer().start()
    try:
        async def go() -> str:
            nc = await bus.connect(f"nats://127.0.0.1:{free_port()},{server.url}", "test")
            try:
                return nc.connected_url.netloc
            finally:
                await nc.close()
        for _ in range(3):
            assert asyncio.run(go()) == f"127.0.0.1:{server.port}"
    finally:
        server.cleanup()


def test_closing_on_purpose_warns_of_nothing_and_losing_the_server_warns(caplog):
    """`orca serve`'s start-up probe closes its connection: no "disconnected" warning for that (a new
    user took it for a fault); a server that goes away still gets one."""
    server = LocalNatsServer().start()
    try:
        async def close_on_purpose() -> None:
            nc = await bus.connect(server.url, "probe")
            await nc.close()

        async def lose_the_server() -> None:
            nc = await bus.connect(server.url, "service")
            server.cleanup()
            for _ in range(100):
                if any("service: disconnected" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.05)
            await nc.close()

        with caplog.at_level(logging.DEBUG, logger="orca.bus"):
            asyncio.run(close_on_purpose())
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
            assert "probe: closed its NATS connection" in caplog.text
            asyncio.run(lose_the_server())
        assert [r.levelname for r in caplog.records if "service: disconnected" in r.getMessage()] == ["WARNING"]
    finally:
        server.cleanup()

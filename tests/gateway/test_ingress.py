"""The Ray Serve set-up of the gateway, without starting Serve: direct ingress on the one port asked
for, and that port bound so that a restarted replica can take it back (the chaos test kills the
replica for real)."""

from __future__ import annotations

import asyncio

from ray.serve._private import replica

from services.gateway.app import SERVE_ENV, rebindable_direct_ingress, serve_env


def test_the_replica_listens_on_exactly_the_port_asked_for():
    env = serve_env(8123)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("8123",
                                                                                                             "8124")
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0", "a restarted replica must get its one port back at once"
    assert SERVE_ENV.items() <= env.items()


def test_the_direct_ingress_port_is_bound_reusable(monkeypatch):
    calls = []

    async def ray_start(app, http_options, *, event_loop, enable_so_reuseport=False):
        calls.append(enable_so_reuseport)
        return "server"

    monkeypatch.setattr(replica, "start_asgi_http_server", ray_start)
    assert rebindable_direct_ingress() and rebindable_direct_ingress(), "idempotent"
    wrapped = replica.start_asgi_http_server
    assert wrapped is not ray_start
    assert asyncio.run(wrapped("app", "options", event_loop=None)) == "server"
    assert calls == [True], "SO_REUSEADDR/SO_REUSEPORT asked for, and the wrapper applied once"

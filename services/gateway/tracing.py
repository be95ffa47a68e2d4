"""An HTTP server span per API call, parented to the caller's W3C `traceparent` header; the NATS
messages the call publishes carry it on (`EngineClient.submit`), so one trace runs from the client
through the gateway, tokenizer, admission and engine."""

from __future__ import annotations

from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.telemetry import context_from_headers, get_tracer

UNTRACED_PATHS = frozenset({"/health", "/metrics"})
"""Scraped every few seconds: spans of them would bury the requests."""


class TraceRequests:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.tracer = get_tracer("orca.gateway")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k in (b"traceparent", b"tracestate")}
        method = scope.get("method", "GET")
        with self.tracer.start_as_current_span(
                f"{method} {scope['path']}", context=context_from_headers(headers), kind=SpanKind.SERVER,
                attributes={"http.request.method": method, "url.path": scope["path"]}) as span:
            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            try:
                await self.app(scope, receive, traced_send)
            finally:
                route = scope.get("route")
                if route is not None:  # the template, not the path: bounded span names
                    span.update_name(f"{method} {route.path}")
                    span.set_attribute("http.route", route.path)

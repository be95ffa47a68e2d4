"""Plain ASGI middleware, outermost first: count responses, check the bearer token, bound the body."""

from __future__ import annotations

import asyncio
import hmac
from collections import Counter

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import APIError

PUBLIC_PATHS = frozenset({"/health", "/metrics"})


class OpenRequests:
    """HTTP requests this process is still answering (a drain waits for zero)."""

    def __init__(self) -> None:
        self.count = 0


CLIENT_CLOSED_REQUEST = 499
"""nginx's code (and Ray Serve's access log's) for a request whose client left before any response."""


class CountResponses:
    """Responses by route template and status code, for /metrics, and the requests still open. A request
    whose client went away before a response started counts as 499, not as a server error."""

    def __init__(self, app: ASGIApp, counts: Counter, open_requests: OpenRequests) -> None:
        self.app = app
        self.counts = counts
        self.open_requests = open_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: dict[str, int | None] = {"code": None}
        gone = False

        async def watching_receive() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        self.open_requests.count += 1
        try:
            await self.app(scope, watching_receive, counting_send)
        except asyncio.CancelledError:  # the server cancels a request whose client went away
            gone = True
            raise
        finally:
            self.open_requests.count -= 1
            route = scope.get("route")
            code = status["code"] if status["code"] is not None else CLIENT_CLOSED_REQUEST if gone else 500
            self.counts[(getattr(route, "path", "other"), code)] += 1


class RequireBearer:
    """`Authorization: Bearer <key>` on every route but /health and /metrics; constant-time compare."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class LimitBody:
    """413 for a body over `limit` bytes, by Content-Length or as it streams in, before any parsing.
    The body is read here (it is small) and replayed to the app."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"The request body is larger than {self.limit} bytes.", code="request_too_large")
        response = error.response()
        response.headers["Connection"] = "close"
        await response(scope, receive, send)

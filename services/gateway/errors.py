"""OpenAI-style error bodies (`{"error": {"message", "type", "param", "code"}}`) and the mapping
from a generation's error text to an HTTP status: the user's input is a 4xx, never a 5xx."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

RETRY_AFTER_S = 1

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "internal_server_error", 503: "service_unavailable_error"}

# Error texts of the tokenizer, admission and engine that mean the request itself is wrong.
USER_ERROR_MARKERS = ("prompt has", "KV slots", "must be", "outside the vocabulary", "is empty", "already in use",
                      "chat template", "malformed JSON", "unknown field", "Expected", "give exactly one",
                      "structured output")
QUEUE_FULL_MARKER = "queue is full"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> Response:
        return Response(msgspec.json.encode(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def queue_full(message: str = "the admission queue is full; retry later") -> APIError:
    return APIError(429, message, code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


UNAVAILABLE_RETRY_AFTER_S = 5
"""What a retryable 503 (no tokenizer, no engine, a stack shutting down) tells the client to wait."""


def from_generation_error(text: str | None, retry: bool = False) -> APIError:
    """A generation that ended with finish_reason "error": whose fault was it? `retry` (the event's flag: a
    cause that passes) is never the request's fault: a 429 for a full queue, else a 503, both with
    Retry-After. Otherwise the error text says whether the request itself was wrong (400)."""
    text = text or "the request failed"
    if QUEUE_FULL_MARKER in text:
        return queue_full(text)
    if retry:
        return APIError(503, text, code="engine_unavailable",
                        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})
    if any(marker in text for marker in USER_ERROR_MARKERS):
        return APIError(400, text)
    return APIError(503, text, code="engine_unavailable")

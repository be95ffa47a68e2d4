"""What one gateway process holds: its settings, the NATS client, the tokenizer, its counters."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from engine.tokenizer import Tokenizer
from services.gateway.engine_client import EngineClient
from services.gateway.errors import APIError, queue_full
from services.gateway.prompts import Prompts
from shared import env

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Bodies past this get a 413 before they are parsed (NATS' own limit is 8 MiB here, 1 MiB by default)."""


@dataclass(frozen=True)
class GatewaySettings:
    nats_url: str
    model: str
    """The checkpoint directory (tokenizer, config.json)."""
    served_model_name: str | None = None
    """The name clients pass as `model`; None means `model` as given."""
    api_key: str | None = field(default=None, repr=False)
    """Bearer token every route but /health and /metrics requires; None: no auth."""
    allowed_origins: tuple[str, ...] = field(default_factory=env.allowed_origins)
    """Origins browsers may call it from (CORS preflights need no key); (): no CORS headers."""
    max_body_bytes: int = MAX_BODY_BYTES
    chat_template: str | None = None
    """--chat-template: a Jinja file or the template text, rendered instead of the checkpoint's."""

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


class GatewayState:
    def __init__(self, settings: GatewaySettings, client: EngineClient, tokenizer: Tokenizer, vocab_size: int,
                 config_context: int, http_requests: Counter) -> None:
        self.settings = settings
        self.client = client
        self.tokenizer = tokenizer
        self.prompts = Prompts(tokenizer, vocab_size)
        self.config_context = config_context
        """The model's context from config.json, until an engine reports its own."""
        self.started = int(time.time())
        self.http_requests = http_requests
        """Responses by (route, status code), counted by the middleware."""
        self.tokens: Counter[str] = Counter()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def check_can_take(self) -> None:
        """Before any work: 503 while no engine is ready, 429 (with Retry-After) while the queue is full."""
        status = self.client.status
        why = status.unavailable()
        if why is not None:
            raise APIError(503, f"{why}; retry later", code="engine_unavailable", headers={"Retry-After": "5"})
        if status.queue_full:
            raise queue_full()

    def context_len(self) -> int:
        return self.client.status.max_model_len() or self.config_context

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (part of a character too), where the tokenizer knows them."""
        own = getattr(self.tokenizer, "token_bytes", None)
        return own(token_id) if own is not None else self.token_text(token_id).encode()

    def model_card(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": self.started,
                "owned_by": "orca-serve", "root": self.settings.model, "max_model_len": self.context_len()}

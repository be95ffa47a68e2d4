"""An in-memory gateway: the real FastAPI app and GatewayState, with a fake engine client (its
generate events are scripted per request) and a fake tokenizer (one token per character) that
records what the chat template was given. No NATS, no model: milliseconds per request."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from fastapi.testclient import TestClient

from services.gateway.app import build_app
from services.gateway.engine_client import Event, Generation
from services.gateway.state import GatewaySettings, GatewayState
from services.gateway.status import StatusBoard
from shared.api import GenerateRequest, Usage
from shared.messages import AdmissionStatus, EngineStatus, TokenizerStatus

VOCAB = 0x3000


class FakeTokenizer:
    """Token t is the character chr(t); a chat renders as `role: content` lines."""

    eos_token_id = 0
    eos_token_ids = (0,)

    def __init__(self) -> None:
        self.rendered: list[tuple[list[dict], list[dict] | None]] = []
        self.template_kwargs: list[dict | None] = []
        self.special: list[bool] = []
        self.documents: list[list | None] = []
        """(messages, tools) of every chat template call."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Records `add_special_tokens` (this tokenizer has no special tokens to add)."""
        self.special.append(add_special_tokens)
        return [ord(c) for c in text]

    def decode(self, token_ids) -> str:
        return "".join(chr(t) for t in token_ids)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            chat_template: str | None = None, turn=None, template_kwargs=None,
                            documents=None) -> list[int]:
        self.rendered.append((messages, tools))
        self.template_kwargs.append(template_kwargs)
        self.documents.append(documents)
        opened = "assistant:" if turn is None or turn.add_generation_prompt else ""
        return self.encode("".join(f"{m['role']}: {m.get('content')}\n" for m in messages) + opened)


def healthy_board() -> StatusBoard:
    board = StatusBoard()
    board.on_admission(AdmissionStatus(queue_len=0, max_queue_len=8, num_engines_ready=1))
    board.on_engine(EngineStatus(replica="0", incarnation="i", ready=True, block_size=16, num_blocks=100,
                                 admissible_blocks=100, num_running=0, num_waiting=0, max_num_seqs=4,
                                 max_model_len=512, last_admit_sequence=0, iteration=0, kv_used_blocks=0))
    board.on_tokenizer(TokenizerStatus("t", num_active=0))
    return board


Script = Callable[[GenerateRequest], list]
"""A request's output, as the texts of its events (the last one ends it): each a text, its tokens being
its characters, or (text, token ids) for text that lags its tokens (held back by the tokenizer)."""


class FakeEngineClient:
    """Records the requests the gateway publishes and answers each with its scripted events."""

    def __init__(self, script: Script, finish_reason: str = "stop", lockstep: bool = False) -> None:
        self.script = script
        self.finish_reason = finish_reason
        self.lockstep = lockstep
        """Deliver each event only once the gateway has taken the one before (so each gets its own
        write, whatever the machine's load); otherwise all at once, so the gateway coalesces them."""
        self.status = healthy_board()
        self.submitted: list[GenerateRequest] = []
        self.by_public_id: dict[str, Generation] = {}

    async def submit(self, public_id: str, requests: list[GenerateRequest]) -> Generation:
        self.submitted += requests
        generation = Generation(self, public_id, requests)
        asyncio.get_running_loop().call_soon(self._answer, generation)
        return generation

    def _answer(self, generation: Generation) -> None:
        by_choice = [self._events(request) for request in generation.requests]
        if self.lockstep:
            asyncio.get_running_loop().create_task(self._deliver_in_lockstep(generation, by_choice))
            return
        for index, events in enumerate(by_choice):
            for event in events:
                generation.deliver(index, event)

    @staticmethod
    async def _deliver_in_lockstep(generation: Generation, by_choice: list[list[Event]]) -> None:
        for index, events in enumerate(by_choice):
            for event in events:
                generation.deliver(index, event)
                while generation.arrived and not generation.closed:
                    await asyncio.sleep(0.001)

    def _events(self, request: GenerateRequest) -> list[Event]:
        """The scripted events of one request, its last one carrying the finish reason and usage."""
        texts = self.script(request)
        scripted = [item if isinstance(item, tuple) else (item, [ord(c) for c in item]) for item in texts]
        events = []
        for i, (text, ids) in enumerate(scripted):
            last = i == len(scripted) - 1
            events.append(Event(
                request.id, ids, text, self.finish_reason if last else None,
                usage=Usage(len(request.prompt_token_ids or ()), sum(len(e[1]) for e in scripted)) if last else None,
                logprobs=[{"token_id": t, "logprob": -1.0, "top_logprobs": []} for t in ids]
                if request.logprobs is not None else None,
                prompt_logprobs=prompt_logprobs(request) if i == 0 else None))
        return events

    def abort_soon(self, request_ids: list[str]) -> None:
        pass

    def forget(self, generation: Generation) -> None:
        pass


def prompt_logprobs(request: GenerateRequest) -> list[dict] | None:
    """What an engine sends for a prompt: each token after the first at -2, and (with k) the next id at -3."""
    if request.prompt_logprobs is None:
        return None
    top = [{"token_id": 0, "logprob": -3.0}] if request.prompt_logprobs else []
    return [{"token_id": t, "logprob": -2.0, "top_logprobs": top} for t in (request.prompt_token_ids or [])[1:]]


def fake_gateway(script: Script, finish_reason: str = "stop",
                 lockstep: bool = False) -> tuple[TestClient, FakeEngineClient, FakeTokenizer]:
    """The gateway app, its engine client and its tokenizer (the app's lifespan is not run: no NATS)."""
    settings = GatewaySettings(nats_url="nats://unused", model="m")
    app = build_app(settings)
    client, tokenizer = FakeEngineClient(script, finish_reason, lockstep), FakeTokenizer()
    app.state.gateway = GatewayState(settings, client, tokenizer, VOCAB, 512, Counter())
    return TestClient(app), client, tokenizer

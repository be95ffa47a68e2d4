"""A request as the iteration scheduler sees it: tokens so far, what is computed, and its state."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from shared.outputs import FinishReason
from shared.sampling import SamplingParams


class RequestStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    """Lower runs first (vLLM's convention); equal priorities are served FCFS."""
    arrival_order: int = 0
    """Set by the scheduler: FCFS position, the tie-breaker everywhere."""
    admitted_order: int = 0
    """Set at each admission; the latest admitted is preempted first."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (the prompt, then each fed-back output token)."""
    num_tokens_sent: int = 0
    """Tokens the runner has been told of (in NewRequestData or ScheduledRequest.new_token_ids)."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    grammar_ready: bool = True
    """False while a structured-output request's grammar compiles: it waits, and is not admitted."""
    cache_salt: str | None = None
    """vLLM's: with prefix caching, it reuses only prefixes cached by requests with the same salt."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def output_limit(self, max_model_len: int) -> int:
        """Most tokens it may generate: max_tokens, within the context."""
        return self.params.output_limit(len(self.prompt_token_ids), max_model_len)

    def peak_tokens(self, max_model_len: int) -> int:
        """The KV slots Orca reserves: prompt_len + max_tokens, within the context."""
        return len(self.prompt_token_ids) + self.output_limit(max_model_len)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def queue_key(request: Request) -> tuple[int, int]:
    """Order of the waiting queue: priority, then arrival."""
    return (request.priority, request.arrival_order)


def victim_key(request: Request) -> tuple[int, int]:
    """Preemption order: lowest priority first, then the latest admitted."""
    return (request.priority, request.admitted_order)

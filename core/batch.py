"""The data that crosses the scheduler/runner boundary once per iteration.

Batch data flow, where it starts and who owns each stage:
1. The engine (in process, or the engine-master service) calls `Scheduler.schedule()`,
   which returns a `SchedulerOutput`: which requests run this iteration, how many tokens
   each computes (a whole prompt, a prefill chunk, or one decode token) and which KV
   blocks each may write. It is plain data, so it can travel to workers as one message.
2. The model runner (worker) keeps per-request token lists and block tables, updated from
   `new_requests`, `new_token_ids` and `new_block_ids`; it concatenates all scheduled tokens into one
   `(sum L_i,)` batch (selective batching), runs the model, and samples one token for each
   request whose scheduled tokens reach the end of what it knows (`samples`).
3. It answers with a `RunnerOutput` (sampled token and logprobs per request).
4. `Scheduler.update(scheduler_output, runner_output)` appends the tokens, decides who
   finished (EOS, stop token, length), frees their KV and returns `RequestOutput` events.
"""

from __future__ import annotations

import msgspec

from shared.outputs import TokenLogprob
from shared.sampling import SamplingParams
from shared.structured import StructuredOutputs


class NewRequestData(msgspec.Struct, frozen=True, array_like=True):
    """A request the runner has not seen yet (or sees again after a preemption)."""

    request_id: str
    token_ids: list[int]
    """Prompt followed by any tokens generated before a preemption."""
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]


class ScheduledRequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    request_id: str
    num_computed_tokens: int
    """Tokens already in the KV cache; this iteration computes the next `num_new_tokens`."""
    num_new_tokens: int
    new_block_ids: list[int]
    """Blocks granted this iteration, appended to the request's block table (for a request
    in `new_requests` they are already in its `block_ids`)."""
    samples: bool
    """True when this iteration reaches the request's last known token, so one is sampled."""
    new_token_ids: list[int] = []
    """Tokens generated since the runner last heard of this request (its inputs this iteration).
    Sampled tokens come back through the scheduler, so every pipeline stage learns them the same
    way, not only the last stage that sampled them; except under async scheduling (one worker),
    where the runner keeps what it samples (`SchedulerOutput.runner_keeps_samples`)."""


class SchedulerOutput(msgspec.Struct, frozen=True, array_like=True):
    """Also the step message the engine master sends its workers, once per iteration."""

    iteration: int
    new_requests: list[NewRequestData]
    scheduled: list[ScheduledRequest]
    """Batch order: decodes first, then prefills, each in admission order."""
    finished_request_ids: list[str]
    """Requests that ended since the previous iteration; the runner drops their state."""
    preempted_request_ids: list[str] = []
    """Requests preempted in this schedule (their KV is gone); the runner drops their state and
    sees them again in `new_requests` when they resume."""
    dead_request_ids: list[str] = []
    """Scheduled lanes of a static (lockstep) batch whose request has already finished: each
    computes one wasted token (its `new_token_ids` is filler, nothing is sampled) because a dense
    batch runs every lane until its longest member ends. Cost models charge them as decodes."""
    runner_keeps_samples: bool = False
    """Async scheduling: the runner appends the tokens it samples in this iteration to its own
    request state, and the scheduler never sends them back. A request may then be scheduled in the
    next iteration before this one's result is known: its input is the token sampled here."""
    grammars: dict[str, StructuredOutputs] = msgspec.field(default_factory=dict)
    """Structured-output requests that arrived since the last step: the output rank starts compiling
    their grammars now, off the loop, and says in a later `RunnerOutput.grammars_ready` when each is."""
    awaiting_grammars: bool = False
    """Some request waits for its grammar. A step that schedules nothing else is sent only to hear of
    it: the output rank waits a moment for a compile to finish before it answers."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for s in self.scheduled if s.num_new_tokens == 1 and s.samples)

    @property
    def num_dead_tokens(self) -> int:
        return len(self.dead_request_ids)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens - self.num_dead_tokens

    @property
    def is_empty(self) -> bool:
        """Nothing to send the workers."""
        return not self.scheduled and not self.grammars and not self.awaiting_grammars


class RunnerOutput(msgspec.Struct, frozen=True, array_like=True):
    sampled_token_ids: dict[str, int] = msgspec.field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = msgspec.field(default_factory=dict)
    grammars_ready: list[str] = []
    """Requests whose grammar has compiled on the output rank: they may be admitted."""
    grammar_errors: dict[str, str] = msgspec.field(default_factory=dict)
    """Requests whose grammar failed on the output rank (compile, or a refused token): they end in error."""
    grammar_done: list[str] = []
    """Requests whose grammar took its last token this iteration: they are complete."""
    prompt_logprobs: dict[str, tuple[TokenLogprob, ...]] = msgspec.field(default_factory=dict)
    """For requests that asked, with their first sampled token: every prompt token's after the first."""


class StepResult(msgspec.Struct, frozen=True, array_like=True):
    """worker -> engine master, once per iteration: the runner's output or why it failed."""

    iteration: int
    output: RunnerOutput | None = None
    error: str | None = None
    execute_s: float = 0.0
    """Time the worker spent in the runner (the rest of the iteration is control overhead)."""

"""Constrained decoding on the rank that samples: grammars compiled off the engine loop, one llguidance
matcher per constrained request, and one batched token mask before sampling.

The scheduler orders a request's grammar when the request arrives (`SchedulerOutput.grammars`) and
admits it only once this rank reports it compiled (`RunnerOutput.grammars_ready`), so a compile
never stalls a batch. Compiled grammars are kept by grammar text: a schema seen before is ready at once,
and a request preempted by recompute gets its matcher back by replaying its generated tokens.
A matcher advances with each token sampled for its request; when its grammar can take no more
tokens the request is done (`RunnerOutput.grammar_done`). The mask of an iteration depends only on
tokens already sampled: the runner fills it once the forward pass is queued, so on CUDA it is filled
while the GPU works (as vLLM does). On the CPU the forward pass has run by then; filling it on a
second thread during the pass measured slower here (benchmarks/README.md, "Structured outputs").
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from orca_kernels.token_bitmask import apply_token_bitmask
from shared.structured import StructuredOutputs

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

MAX_COMPILED = 512
"""Compiled grammars kept (least recently used dropped first); a dropped one is compiled again."""
POLL_WAIT_S = 0.005
"""On a step that only waits for compiles, how long to wait for one to finish before answering."""


class GrammarMatchers:
    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.matchers: dict[str, LLMatcher] = {}  # request id -> its matcher, while it runs here
        self._tokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()  # grammar text -> matcher at its start
        self._lock = threading.Lock()
        self._pending: dict[str, Future[LLMatcher]] = {}  # request id -> its compile
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    # ---- compiling, off the loop ---------------------------------------------------------

    def order(self, grammars: dict[str, StructuredOutputs]) -> None:
        for request_id, spec in grammars.items():
            self._pending[request_id] = self._pool.submit(self._prototype, spec.grammar_text())

    def report(self, wait_s: float = 0.0) -> tuple[list[str], dict[str, str]]:
        """Requests whose grammar compiled since the last report, and those whose grammar failed."""
        if wait_s and self._pending and not any(f.done() for f in self._pending.values()):
            wait(list(self._pending.values()), timeout=wait_s, return_when="FIRST_COMPLETED")
        ready, errors = [], {}
        for request_id, future in list(self._pending.items()):
            if future.done():
                del self._pending[request_id]
                error = future.exception()
                if error is None:
                    ready.append(request_id)
                else:
                    errors[request_id] = str(error)
        return ready, errors

    def _prototype(self, grammar: str) -> LLMatcher:
        from llguidance import LLMatcher

        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
            tokenizer = self._llg_tokenizer()
        matcher = LLMatcher(tokenizer, grammar, log_level=0)  # llguidance drops the GIL while it builds
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return matcher

    def _llg_tokenizer(self) -> LLTokenizer:
        """Built on first use: workers that never see a grammar never load the tokenizer."""
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(self.model_dir)
            eos = list(self.eos_token_ids) or None
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer

    # ---- one matcher per running request -------------------------------------------------

    def open(self, request_id: str, spec: StructuredOutputs, generated: list[int]) -> None:
        """The request's matcher, advanced past the tokens it already generated (after a preemption).
        Compiles here only if the grammar was dropped from the cache or this worker restarted."""
        matcher = self._prototype(spec.grammar_text()).deep_copy()
        if generated and not matcher.consume_tokens(generated):
            raise ValueError(f"request {request_id}: its tokens do not match its grammar: {matcher.get_error()}")
        self.matchers[request_id] = matcher

    def close(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self._pending.pop(request_id, None)

    def fill(self, request_ids: list[str]) -> Mask | None:
        """The rows with a grammar and their bitmask; None when no row has one. A grammar that has ended
        allows only EOS (a step scheduled ahead, or tokens resumed up to its end)."""
        from llguidance.torch import fill_next_token_bitmask

        rows = [row for row, rid in enumerate(request_ids) if rid in self.matchers]
        if not rows:
            return None
        bitmask = torch.full((len(rows), -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        for i, row in enumerate(rows):
            fill_next_token_bitmask(self.matchers[request_ids[row]], bitmask, i)
        return rows, bitmask

    def mask(self, logits: torch.Tensor, request_ids: list[str], filled: Mask | None = None) -> None:
        """Set to -inf, in place, every token a row's grammar does not allow next; other rows are left as
        they are. `filled`: what `fill(request_ids)` returned, if it was called already."""
        mask = filled if filled is not None else self.fill(request_ids)
        if mask is not None:
            apply_token_bitmask(logits, *mask)

    def advance(self, request_ids: list[str], tokens: list[int]) -> tuple[list[str], dict[str, str]]:
        """Each constrained request takes its sampled token: the requests whose grammar has now ended,
        and any whose matcher failed (a token outside the mask: a bug, reported rather than hidden)."""
        done, errors = [], {}
        for rid, token in zip(request_ids, tokens):
            matcher = self.matchers.get(rid)
            if matcher is None:
                continue
            if matcher.is_stopped():  # it ended before this token (EOS, by its mask): done, if not already
                done.append(rid)
            elif not matcher.consume_token(token):
                # llguidance appends its parser's state and the whole grammar: the first line says it
                errors[rid] = f"the grammar refused token {token}: {matcher.get_error().split(chr(10))[0]}"
            elif matcher.is_stopped():
                done.append(rid)
        return done, errors


Mask = tuple[list[int], torch.Tensor]
"""Rows of an iteration's logits, and their bitmask."""

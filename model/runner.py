"""The model runner: owns the model, the preallocated KV cache and per-request state, and
turns one `SchedulerOutput` into one `RunnerOutput` (selective batching, then sampling).

Under tensor/pipeline parallelism each worker runs one: its stage's layers, its shard of
each. Every stage keeps the same request state and builds the same batch metadata from the
step message; the first stage embeds the tokens, the others receive the previous stage's
hidden states and residual, and only the output rank (last stage, TP rank 0) samples."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from core.batch import NewRequestData, RunnerOutput, ScheduledRequest, SchedulerOutput
from shared.outputs import TokenLogprob
from orca_kernels.backend import CPU_OP_SETS, get_kernel_ops
from model.distributed import ParallelGroups
from model.loader import load_model, resolve_dtype
from model.compiled import CompiledForward, warm_up
from model.cpu_linear import can_pack, pack_linears
from model.metadata import AttentionMetadata
from model.arch import eos_token_ids
from model.sampler import SamplingState, prompt_logprobs, sample
from model.structured import POLL_WAIT_S, GrammarMatchers
from model.tensor_parallel import local_kv_heads


SMALL_STEP_TOKENS = 48
"""CPU iterations of fewer tokens run on one torch thread: a decode of up to 32 requests on the tiny Llama
took 1.3-2.0 ms on one thread against 1.7-3.1 ms on two (waking the second thread costs more than it
brings); from about 64 tokens two threads win (6.5 vs 7.2 ms at 64 decodes, 182 vs 323 ms for a
6,400-token prefill)."""


@dataclass
class RequestState:
    token_ids: list[int]  # prompt + generated; the runner feeds them back as inputs
    block_ids: list[int]
    sampling: SamplingState
    num_prompt_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    """Collected chunk by chunk for a request that asked for them, until its first token; else None."""


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (N,) rows of the batch whose next token is sampled
    sampled_request_ids: list[str]


class ModelRunner:
    def __init__(self, model_dir: str, *, dtype: str, device: str, num_blocks: int, block_size: int,
                 max_model_len: int, seed: int, kernel_backend: str = "auto",
                 groups: ParallelGroups | None = None, enforce_eager: bool | None = None,
                 borrowed_threads: int = 0) -> None:
        """`enforce_eager`: True runs the plain torch step; False compiles it (model/compiled.py); None
        compiles where it pays: on CUDA, not on CPU (there the token-wise ops already run at matmul speed;
        benchmarks/README.md has the measurement). Compilation covers a single worker (no -tp/-pp).
        `borrowed_threads`: torch threads a single CPU worker may add, on cores it shares with the
        control plane, for a large iteration that decodes nothing (services/cpu_binding.py places them)."""
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, device)
        self.groups = groups or ParallelGroups()
        self.rank = self.groups.rank
        self.model, self.arch = load_model(model_dir, self.dtype, device, max_positions=max_model_len,
                                           groups=self.groups)
        self.block_size = block_size
        compile_step = _should_compile(enforce_eager, self.device, self.groups.rank.world_size)
        # A compiled step leaves the token-wise ops to Inductor, which fuses them; an opaque C call would break its graph.
        self.ops = get_kernel_ops(kernel_backend, self.device.type, self.dtype, fused_token_ops=not compile_step)
        # A compiled step gets one block past the KV manager's: warm-up and CUDA-graph padding write there.
        self.kv_caches = self._allocate_kv_cache(num_blocks + compile_step, block_size)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.requests: dict[str, RequestState] = {}
        self.scoring_prompts: set[str] = set()
        """Requests collecting prompt logprobs: an iteration without any does not look (the hot path)."""
        # Only the rank that samples keeps grammars (structured outputs).
        self.eos_token_ids = eos_token_ids(model_dir)
        self.grammars = (GrammarMatchers(model_dir, self.arch.vocab_size, self.eos_token_ids)
                         if self.rank.is_output_rank else None)
        # One worker on the CPU picks its thread count per iteration (SMALL_STEP_TOKENS); others keep theirs.
        single_cpu_worker = self.device.type == "cpu" and self.groups.rank.world_size == 1
        self.max_threads = torch.get_num_threads() if single_cpu_worker else 1
        self.borrowed_threads = borrowed_threads if single_cpu_worker else 0
        self.compiled: CompiledForward | None = None
        if self.ops in CPU_OP_SETS and can_pack(self.model, self.device, self.dtype) and not compile_step:
            pack_linears(self.model)  # oneDNN with packed weights: about 2x MKL's float32 matmuls here
        if compile_step:
            self.compiled = CompiledForward(self.model, self.ops, self.device, self.kv_caches, scratch_block=num_blocks,
                                            max_blocks_per_seq=-(-max_model_len // block_size))
            warm_up(self.compiled, self.kv_caches, self.device, thread_counts=self._thread_counts())

    def _allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Allocated once at start-up, for this stage's layers and this rank's KV heads."""
        shape = (num_blocks, block_size, local_kv_heads(self.arch, self.rank.tp_size), self.arch.head_dim)
        start, end = self.model.layer_range
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(start, end)]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput | None:
        """The iteration's output on the output rank; None on every other rank. Runs small iterations
        on one torch thread and gives the process its thread count back after (a second engine in the
        process would otherwise take one thread as its most)."""
        threads = torch.get_num_threads()
        if scheduler_output.scheduled:
            self._pick_threads(scheduler_output)
        try:
            return self._execute(scheduler_output)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    @torch.inference_mode()
    def _execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput | None:
        grammar_errors = self._update_states(scheduler_output)
        if not scheduler_output.scheduled:
            return self._with_grammar_news(RunnerOutput(grammar_errors=grammar_errors), scheduler_output)
        batch = self._prepare_inputs(scheduler_output.scheduled)
        grammars = self.grammars
        constrained = grammars is not None and bool(grammars.matchers) and bool(batch.sampled_request_ids)
        hidden = self._run_stage(batch)  # (T, H)
        if hidden is None:
            return None
        self._collect_prompt_logprobs(hidden, scheduler_output.scheduled)
        mask = grammars.fill(batch.sampled_request_ids) if constrained else None  # on CUDA: while the GPU runs
        if not batch.sampled_request_ids:  # only partial prefill chunks this iteration
            return self._with_grammar_news(RunnerOutput(grammar_errors=grammar_errors), scheduler_output)
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # (N, V)
        if constrained:
            grammars.mask(logits, batch.sampled_request_ids, mask)
        states = [self.requests[r] for r in batch.sampled_request_ids]
        tokens, logprobs = sample(logits, [s.sampling for s in states], self.generator)
        done: list[str] = []
        if constrained:
            done, refused = grammars.advance(batch.sampled_request_ids, tokens)
            grammar_errors.update(refused)
        if scheduler_output.runner_keeps_samples:  # async scheduling: the next step may already need them
            for state, token in zip(states, tokens):
                state.token_ids.append(token)
        prompt_logprobs = {}
        for request_id in self.scoring_prompts.intersection(batch.sampled_request_ids):
            state = self.requests[request_id]  # its prompt is complete: they go with its first token
            prompt_logprobs[request_id], state.prompt_logprobs = tuple(state.prompt_logprobs or ()), None
            self.scoring_prompts.discard(request_id)
        return self._with_grammar_news(RunnerOutput(
            sampled_token_ids=dict(zip(batch.sampled_request_ids, tokens)),
            logprobs={r: lp for r, lp in zip(batch.sampled_request_ids, logprobs) if lp is not None},
            grammar_errors=grammar_errors, grammar_done=done, prompt_logprobs=prompt_logprobs,
        ), scheduler_output)

    def _collect_prompt_logprobs(self, hidden: torch.Tensor, scheduled: list[ScheduledRequest]) -> None:
        """The prompt logprobs of this iteration's chunk of each request that wants them: the hidden state at
        position p gives the logprob of prompt token p + 1 (the last prompt position's is the first output's)."""
        if not self.scoring_prompts:
            return
        row = 0
        for item in scheduled:
            state = self.requests[item.request_id]
            first = item.num_computed_tokens
            last = min(first + item.num_new_tokens, state.num_prompt_tokens - 1)
            if item.request_id in self.scoring_prompts and last > first:
                state.prompt_logprobs.extend(prompt_logprobs(
                    self.model.compute_logits, hidden[row:row + last - first], state.token_ids[first + 1:last + 1],
                    state.sampling.params.prompt_logprobs or 0))
            row += item.num_new_tokens

    def _with_grammar_news(self, output: RunnerOutput, scheduler_output: SchedulerOutput) -> RunnerOutput | None:
        """The output rank's answer, with the compiles that finished (waiting a moment for one on a step
        sent only for that); None on every other rank."""
        if not self.rank.is_output_rank:
            return None
        if self.grammars is None or not (scheduler_output.awaiting_grammars or scheduler_output.grammars):
            return output
        ready, failed = self.grammars.report(POLL_WAIT_S if not scheduler_output.scheduled else 0.0)
        if not ready and not failed:
            return output
        return msgspec.structs.replace(output, grammars_ready=ready,
                                       grammar_errors={**output.grammar_errors, **failed})

    def _thread_counts(self) -> tuple[int, ...]:
        """Every torch thread count `_pick_threads` may choose."""
        counts = {1, self.max_threads, self.max_threads + self.borrowed_threads}
        return tuple(sorted(counts)) if len(counts) > 1 else (torch.get_num_threads(),)

    def _pick_threads(self, scheduler_output: SchedulerOutput) -> None:
        """One thread for a small iteration; the worker's own for a large one; its own and the borrowed
        ones for a large iteration that decodes nothing: no token streams out during it, so the control
        plane, whose cores those are, has nothing to do but wait for it (a lone prompt's prefill)."""
        if len(self._thread_counts()) == 1:
            return
        if scheduler_output.num_tokens < SMALL_STEP_TOKENS:
            threads = 1
        elif self.borrowed_threads and scheduler_output.num_decode_tokens == 0:
            threads = self.max_threads + self.borrowed_threads
        else:
            threads = self.max_threads
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def _run_stage(self, batch: BatchInputs) -> torch.Tensor | None:
        """This stage's part of the forward pass; the final hidden states on the output rank."""
        model, rank = self.model, self.rank
        if self.compiled is not None:  # a single worker: the whole forward pass in one compiled call
            return self.compiled(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if rank.is_first_stage:
            h, residual = model.embed(batch.input_ids, batch.positions), None
        else:
            shape = (2, batch.input_ids.shape[0], self.arch.hidden_size)
            h, residual = self.groups.recv_from_previous_stage(shape, self.dtype, self.device).unbind(0)
        h, residual = model.run_layers(h, residual, batch.positions, self.kv_caches, batch.meta, self.ops)
        if not rank.is_last_stage:
            self.groups.send_to_next_stage(torch.stack((h, residual)))
            return None
        if not rank.is_output_rank:
            return None
        return model.final_norm(h, residual, self.ops)

    def _update_states(self, scheduler_output: SchedulerOutput) -> dict[str, str]:
        """Apply the step's bookkeeping; the requests whose grammar could not be opened, with why."""
        grammars = self.grammars
        for request_id in scheduler_output.finished_request_ids + scheduler_output.preempted_request_ids:
            self.requests.pop(request_id, None)
            self.scoring_prompts.discard(request_id)
            if grammars is not None:
                grammars.close(request_id)
        if grammars is not None and scheduler_output.grammars:
            grammars.order(scheduler_output.grammars)
        errors: dict[str, str] = {}
        new_ids = set()
        for new in scheduler_output.new_requests:
            state = self.requests[new.request_id] = self._new_state(new)
            if state.prompt_logprobs is not None:
                self.scoring_prompts.add(new.request_id)
            new_ids.add(new.request_id)
            if grammars is not None and new.params.structured_outputs is not None:
                try:
                    grammars.open(new.request_id, new.params.structured_outputs,
                                  new.token_ids[new.num_prompt_tokens:])
                except ValueError as exc:
                    errors[new.request_id] = str(exc)
        for item in scheduler_output.scheduled:
            if item.request_id not in new_ids:
                state = self.requests[item.request_id]
                state.token_ids.extend(item.new_token_ids)
                state.block_ids.extend(item.new_block_ids)
        return errors

    def _new_state(self, new: NewRequestData) -> RequestState:
        generator = None
        if new.params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(new.params.seed)
        tokens = list(new.token_ids)
        ends = ()
        if new.params.min_tokens:  # ids past the vocabulary are refused before they get here; never index past it
            vocab = self.arch.vocab_size
            ends = tuple(t for t in dict.fromkeys((*self.eos_token_ids, *new.params.stop_token_ids)) if t < vocab)
        # not for one that comes back after its first token (a preemption, a resume): those went with it
        collect = new.params.prompt_logprobs is not None and len(tokens) == new.num_prompt_tokens
        return RequestState(tokens, list(new.block_ids),
                            SamplingState(new.params, tokens, new.num_prompt_tokens, generator, ends),
                            new.num_prompt_tokens, [] if collect else None)

    def _prepare_inputs(self, scheduled: list[ScheduledRequest]) -> BatchInputs:
        """The iteration's flat inputs and attention metadata, built once for all layers: per request
        only a slice of its tokens and of its block table; positions and slots are computed in numpy."""
        bs = self.block_size
        states = [self.requests[item.request_id] for item in scheduled]
        starts = np.fromiter((item.num_computed_tokens for item in scheduled), np.int64, len(scheduled))
        counts = np.fromiter((item.num_new_tokens for item in scheduled), np.int64, len(scheduled))
        ends = starts + counts
        query_start = np.concatenate(([0], np.cumsum(counts)))
        num_blocks = -(-ends // bs)
        tables = np.zeros((len(scheduled), int(num_blocks.max())), dtype=np.int32)
        for row, (state, n) in enumerate(zip(states, num_blocks.tolist())):
            tables[row, :n] = state.block_ids[:n]
        input_ids = np.fromiter(itertools.chain.from_iterable(
            state.token_ids[s:e] for state, s, e in zip(states, starts.tolist(), ends.tolist())), np.int64)
        rows = np.repeat(np.arange(len(scheduled)), counts)  # (T,) the request of each token
        positions = np.arange(len(input_ids)) - query_start[:-1][rows] + starts[rows]
        slots = tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        sampled_rows = [i for i, item in enumerate(scheduled) if item.samples]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor(tables),
            seq_lens=self._tensor(ends.astype(np.int32)),
            query_start_loc=self._tensor(query_start.astype(np.int32)),
            max_query_len=int(counts.max()),
            max_seq_len=int(ends.max()),
        )
        return BatchInputs(self._tensor(input_ids), self._tensor(positions), meta,
                           self._tensor(query_start[1:][sampled_rows] - 1),
                           [scheduled[i].request_id for i in sampled_rows])

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).to(self.device)


def _should_compile(enforce_eager: bool | None, device: torch.device, world_size: int) -> bool:
    if enforce_eager is None:
        return device.type == "cuda" and world_size == 1
    if not enforce_eager and world_size > 1:
        raise ValueError("a compiled model step (--no-enforce-eager) runs a single worker; drop -tp/-pp or use "
                         "--enforce-eager")
    return not enforce_eager

"""The model step under `torch.compile`, and the custom ops that keep its graph whole.

Inductor compiles the token-wise ops (norms, rotary, activations, residual adds, projections) into
fused kernels: C++/OpenMP on CPU, Triton on CUDA. Attention and the KV-cache write run as registered
custom ops (`orca::attention`, `orca::write_kv`), opaque to the compiler, so the graph does not break
around them and the cache is written in place (a traced `index_copy_` into a graph input would make
Inductor copy the whole cache). The token dimension is dynamic and size-oblivious: one graph serves every batch. On CUDA, decode-only iterations are
padded to a few capture sizes and replayed as CUDA graphs (torch.compile's "reduce-overhead" mode),
so a decode step costs one launch instead of hundreds.

Inductor keeps compiled graphs in its on-disk cache (on by default), so the second start is fast.
`warm_up` compiles every graph the engine will use before the first request arrives.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.fx.experimental._config

from orca_kernels.backend import TRITON_OPS, KernelOps
from model.metadata import AttentionMetadata

log = logging.getLogger("orca.model")

CUDA_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Decode batch sizes captured as CUDA graphs (vLLM's capture-sizes idea); larger decodes run uncaptured."""


@dataclasses.dataclass(frozen=True)
class _Kernels:
    """The eager kernels the custom ops call; set once per process by `compiled_ops`."""

    ops: KernelOps


_registered: dict[str, _Kernels] = {}


@torch.library.custom_op("orca::write_kv", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    _registered[k_cache.device.type].ops.write_kv(key, value, k_cache, v_cache, slot_mapping)


@_write_kv_op.register_fake
def _(key, value, k_cache, v_cache, slot_mapping) -> None:
    return None


@torch.library.custom_op("orca::attention", mutates_args=())
def _attention_op(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    return _registered[query.device.type].ops.attention(query, k_cache, v_cache, block_tables, seq_lens,
                                                        query_start_loc, scale)


@_attention_op.register_fake
def _(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale) -> torch.Tensor:
    return query.new_empty(query.shape)


def _attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, *,
               max_query_len=None, max_seq_len=None) -> torch.Tensor:
    # The hints are Python ints; inside a graph they would be specialised (one recompile per value).
    return _attention_op(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def compiled_ops(ops: KernelOps, device_type: str) -> KernelOps:
    """`ops` with attention and the KV write routed through the custom ops (one eager set per device)."""
    _registered[device_type] = _Kernels(ops)
    return dataclasses.replace(ops, write_kv=_write_kv_op, attention=_attention)


class CompiledForward:
    """`model.forward` compiled once for dynamic token counts; call it as the eager forward.

    `scratch_block` is a KV block no request ever owns (the runner allocates one past the manager's):
    warm-up batches and CUDA-graph padding rows write there, never into a live request's cache."""

    def __init__(self, model: torch.nn.Module, ops: KernelOps, device: torch.device, kv_caches: list,
                 scratch_block: int, max_blocks_per_seq: int) -> None:
        self.model = model
        self.ops = compiled_ops(ops, device.type)
        self.scratch_block = scratch_block
        self.max_blocks_per_seq = max_blocks_per_seq
        # Capturable only with kernels that never sync with the host (the torch attention path does).
        self.use_cuda_graphs = device.type == "cuda" and ops is TRITON_OPS
        # CPU only: with CUDA graphs one-token batches never reach the dynamic graph, and Triton's launch
        # heuristics want a size hint, which an unbacked count lacks (not checked on a GPU).
        self.unbacked_tokens = device.type == "cpu"
        # Dynamo caches graphs per code object, and `_forward` is one code object for every instance: a
        # new model (a test's next checkpoint) would count as recompiles of the old one. One model step
        # is compiled per process; start it clean (Inductor's on-disk cache still makes this fast).
        torch._dynamo.reset()
        self._dynamic = torch.compile(self._forward, dynamic=True, fullgraph=True)
        self._graphed = None
        if self.use_cuda_graphs:
            for k_cache, v_cache in kv_caches:  # replayed graphs must not copy the cache in and out
                torch._dynamo.mark_static_address(k_cache)
                torch._dynamo.mark_static_address(v_cache)
            self._graphed = torch.compile(self._forward, dynamic=False, fullgraph=True, mode="reduce-overhead")

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                 meta: AttentionMetadata) -> torch.Tensor:
        if self.unbacked_tokens:  # tell the compiler the three counts are one
            torch._check(positions.shape[0] == input_ids.shape[0])
            torch._check(meta.slot_mapping.shape[0] == input_ids.shape[0])
        return self.model(input_ids, positions, kv_caches, meta, self.ops)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                 meta: AttentionMetadata) -> torch.Tensor:
        if self._graphed is not None and meta.max_query_len == 1:
            size = next((s for s in CUDA_GRAPH_SIZES if s >= input_ids.shape[0]), None)
            if size is not None:
                return self._graph_decode(size, input_ids, positions, kv_caches, meta)
        # Size-oblivious: a batch of one token (or one request, or one block) reuses the general graph
        # instead of specialising on 1; each combination would be a recompile. On the CPU the token count
        # is also unbacked: two lowerings still specialise a backed one on `T == 1` (the rotary's in-place
        # copy, Inductor's view of an unbound qkv), and the second graph compiled while serving.
        if self.unbacked_tokens:
            for tensor in (input_ids, positions, meta.slot_mapping):
                torch._dynamo.decorators.mark_unbacked(tensor, 0)
        with torch.fx.experimental._config.patch(backed_size_oblivious=True, use_duck_shape=False):
            return self._dynamic(input_ids, positions, kv_caches, _tensor_meta(meta))

    def _graph_decode(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                      meta: AttentionMetadata) -> torch.Tensor:
        """A decode step padded to `size` requests and to the widest block table, so each size is one
        captured graph: padding rows are one-token requests in the scratch block; their outputs are dropped."""
        n, pad = input_ids.shape[0], size - input_ids.shape[0]
        pad_1d = torch.nn.functional.pad
        scratch_slot = self.scratch_block * self.ops_block_size(kv_caches)
        width = self.max_blocks_per_seq - meta.block_tables.shape[1]
        padded = AttentionMetadata(
            slot_mapping=pad_1d(meta.slot_mapping, (0, pad), value=scratch_slot),
            block_tables=pad_1d(meta.block_tables, (0, width, 0, pad), value=self.scratch_block),
            seq_lens=pad_1d(meta.seq_lens, (0, pad), value=1),
            query_start_loc=torch.cat([meta.query_start_loc, meta.query_start_loc[-1] + torch.arange(
                1, pad + 1, device=input_ids.device, dtype=torch.int32)]),
            max_query_len=0, max_seq_len=0)
        return self._graphed(pad_1d(input_ids, (0, pad)), pad_1d(positions, (0, pad)), kv_caches, padded)[:n]

    @staticmethod
    def ops_block_size(kv_caches: list) -> int:
        return kv_caches[0][0].shape[1]


def _tensor_meta(meta: AttentionMetadata) -> AttentionMetadata:
    # Only tensors enter the graph: the int hints would be specialised.
    return dataclasses.replace(meta, max_query_len=0, max_seq_len=0)


def warm_up(forward: CompiledForward, kv_caches: list, device: torch.device,
            thread_counts: tuple[int, ...] = ()) -> float:
    """Compile every graph before serving: one token, a few tokens, a prompt; on CUDA each captured
    decode size; under each of `thread_counts` (torch threads are part of a graph's guards, and the
    CPU runner switches them per step). Writes only the scratch block. Returns the seconds it took."""
    start = time.perf_counter()
    block_size = CompiledForward.ops_block_size(kv_caches)
    shapes = [(1, 1), (2, 1), (1, block_size), (3, max(2, block_size // 2))]  # (requests, tokens each)
    if forward.use_cuda_graphs:
        shapes += [(size, 1) for size in CUDA_GRAPH_SIZES]
    threads_before = torch.get_num_threads()
    with torch.inference_mode():  # as the runner calls it: grad mode is part of every graph's guards
        for threads in thread_counts or (threads_before,):
            torch.set_num_threads(threads)
            for num_requests, q_len in shapes:
                forward(*_dummy_batch(num_requests, q_len, forward.scratch_block, block_size, device, kv_caches))
    torch.set_num_threads(threads_before)
    seconds = time.perf_counter() - start
    log.info("compiled the model step in %.1f s", seconds)
    return seconds


def _dummy_batch(num_requests: int, q_len: int, scratch_block: int, block_size: int, device: torch.device,
                 kv_caches: list) -> tuple[torch.Tensor, torch.Tensor, list, AttentionMetadata]:
    """Every request reads and writes positions 0 .. q_len - 1 of the scratch block (q_len <= block_size)."""
    positions = torch.arange(q_len, device=device).repeat(num_requests)
    meta = AttentionMetadata(
        slot_mapping=scratch_block * block_size + positions,
        block_tables=torch.full((num_requests, 1), scratch_block, dtype=torch.int32, device=device),
        seq_lens=torch.full((num_requests,), q_len, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(0, num_requests * q_len + 1, q_len, dtype=torch.int32, device=device),
        max_query_len=q_len, max_seq_len=q_len)
    return torch.zeros(num_requests * q_len, dtype=torch.int64, device=device), positions, kv_caches, meta

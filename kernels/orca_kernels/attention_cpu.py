"""Ragged paged attention on the CPU in one compiled call per layer (kernels/orca_kernels/csrc/ragged_attention.c).

Same arguments and result as `orca_kernels.attention.ragged_attention_torch`, which stays its reference
and the fallback where no C compiler is at hand. One call covers every request of the iteration,
prompt chunks and decodes alike, reading K/V straight from the paged cache through the block
tables: no Python per request, no gather, scattered blocks as fast as consecutive ones.
"""

from __future__ import annotations

import ctypes

import torch

from orca_kernels import cpu_build
from orca_kernels.attention import _check_attention_args

_DTYPES = {torch.float32: "ragged_attention_f32", torch.float64: "ragged_attention_f64"}
_ARGTYPES = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 9 + [ctypes.c_double]


def _function(dtype: torch.dtype):
    library = cpu_build.load("ragged_attention")
    if library is None or dtype not in _DTYPES:
        return None
    function = getattr(library, _DTYPES[dtype])
    function.argtypes, function.restype = _ARGTYPES, ctypes.c_int
    return function


def available(dtype: torch.dtype) -> bool:
    """Whether the compiled kernel runs `dtype` on this machine (float32 and float64, with a C compiler)."""
    return _function(dtype) is not None


def ragged_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         scale: float, *, max_query_len: int | None = None,
                         max_seq_len: int | None = None) -> torch.Tensor:
    """Arguments and result as `orca_kernels.attention.ragged_attention_torch`'s; `query` may have any token and
    head strides (unit stride along head_dim). `max_query_len` is not needed here; `max_seq_len`, when
    the caller knows it, saves a reduction."""
    _check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if query.device.type != "cpu":
        raise ValueError(f"ragged_attention_cpu runs on cpu tensors, got {query.device}")
    function = _function(query.dtype)
    if function is None:
        raise ValueError(f"the compiled CPU attention kernel is not available for {query.dtype} here")
    if query.stride(2) != 1:
        raise ValueError("query needs a unit stride along head_dim")
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_tables, seq_lens, query_start_loc = (t.contiguous() for t in (block_tables, seq_lens, query_start_loc))
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    failed = function(
        out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), seq_lens.data_ptr(), query_start_loc.data_ptr(),
        num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], block_tables.shape[1],
        query.stride(0), query.stride(1), max_seq_len, scale,
    )  # fmt: skip
    if failed:
        raise MemoryError("ragged_attention_cpu could not allocate its scratch buffers")
    return out

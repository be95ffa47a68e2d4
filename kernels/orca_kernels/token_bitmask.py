"""Applying structured outputs' token bitmask to an iteration's logits: every token whose bit is clear
becomes -inf. The compiled CPU kernel (kernels/orca_kernels/csrc/token_bitmask.c) for float32 and float64 logits on
the CPU, whose work follows the refused tokens; torch (`apply_token_bitmask_torch`, its reference) for
every other dtype and device, and where no C compiler is at hand."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from orca_kernels import cpu_build

_DTYPES = {torch.float32: "apply_token_bitmask_f32", torch.float64: "apply_token_bitmask_f64"}
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
             ctypes.c_int64]


def _function(dtype: torch.dtype):
    library = cpu_build.load("token_bitmask")
    if library is None or dtype not in _DTYPES:
        return None
    function = getattr(library, _DTYPES[dtype])
    function.argtypes, function.restype = _ARGTYPES, None
    return function


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """logits (N, V), rows: which rows the bitmask's rows mask; bitmask (len(rows), ceil(V/32)) int32 on the
    CPU, bit j of word w allowing token 32w + j. In place."""
    function = _function(logits.dtype) if logits.device.type == "cpu" and logits.stride(1) == 1 else None
    if function is None:
        apply_token_bitmask_torch(logits, rows, bitmask)
        return
    bitmask = bitmask.contiguous()
    index = np.asarray(rows, dtype=np.int64)
    function(logits.data_ptr(), logits.stride(0), index.ctypes.data, len(rows), bitmask.data_ptr(),
             bitmask.shape[1], logits.shape[1])


def apply_token_bitmask_torch(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """The reference, for any dtype and device. Unpacked by numpy (little-endian words are little-endian
    bytes): a tenth of the time of shifting each bit out in torch here."""
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    refused = torch.from_numpy(bits == 0).to(logits.device)
    minus_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = torch.where(refused, minus_inf, logits[index])

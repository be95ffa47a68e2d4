"""The token-wise ops of a layer on the CPU in float32, one compiled call each (kernels/orca_kernels/csrc/token_ops.c).

Same signatures and results (to float32 rounding) as the torch versions in kernels/orca_kernels/norms.py,
kernels/orca_kernels/rotary.py, kernels/orca_kernels/kv_cache.py and kernels/orca_kernels/activations.py (SwiGLU), which stay their references, the
float64 path (bit for bit with transformers) and the fallback where no C compiler is at hand. What
they save is dispatch: at decode sizes a torch RMSNorm is nine ops, a rotary fourteen, each costing
more than its arithmetic; here each is one call.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from orca_kernels import cpu_build

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "rms_norm_f32": [_PTR] * 5 + [_I64] * 2 + [ctypes.c_double],
    "rotary_f32": [_PTR] * 5 + [_I64] * 8,
    "write_kv_f32": [_PTR] * 5 + [_I64] * 7,
    "silu_and_mul_f32": [_PTR] * 2 + [_I64] * 3,
}


@cache
def _functions() -> dict[str, ctypes._CFuncPtr] | None:
    library = cpu_build.load("token_ops")
    if library is None:
        return None
    functions = {}
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
        functions[name] = function
    return functions


def available() -> bool:
    """Whether the compiled token ops build here (a C compiler is found)."""
    return _functions() is not None


def _function(name: str) -> ctypes._CFuncPtr:
    functions = _functions()
    if functions is None:
        raise ValueError("the compiled CPU token ops are not available here (no C compiler)")
    return functions[name]


def _rows(t: torch.Tensor) -> torch.Tensor:
    # Only the dtype is checked per call (cheap); kernels/orca_kernels/backend.py picks these ops for cpu float32 models.
    if t.dtype is not torch.float32:
        raise ValueError(f"the CPU token ops take float32 tensors, got {t.dtype}")
    return t.contiguous()


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * s / rms(s), s) with s = x + residual (or x): as orca_kernels.norms.rms_norm_torch."""
    x, weight = _rows(x), _rows(weight)
    rows, hidden = x.shape
    out = torch.empty_like(x)
    if residual is None:
        s, residual_ptr = x, None
    else:
        residual = _rows(residual)
        s, residual_ptr = torch.empty_like(x), residual.data_ptr()
    _function("rms_norm_f32")(out.data_ptr(), s.data_ptr(), x.data_ptr(), residual_ptr, weight.data_ptr(),
                              rows, hidden, eps)
    return out, s


def apply_rotary_cpu(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor) -> None:
    """query (T, nh, hd) and key (T, nkv, hd), strided views allowed, rotated in place: as
    orca_kernels.rotary.apply_rotary_torch."""
    tokens, num_q_heads, head_dim = query.shape
    if key.shape[0] != tokens or key.shape[2] != head_dim or query.stride(2) != 1 or key.stride(2) != 1:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} need one token count, "
                         "one head_dim and a unit stride along it")
    if query.dtype != torch.float32 or key.dtype != torch.float32 or positions.dtype != torch.int64:
        raise ValueError("apply_rotary_cpu takes float32 query/key and int64 positions")
    cos, sin, positions = cos.contiguous(), sin.contiguous(), positions.contiguous()
    if cos.shape[1] * 2 != head_dim:
        raise ValueError(f"cos/sin must be (max_positions, {head_dim // 2}), got {tuple(cos.shape)}")
    _function("rotary_f32")(query.data_ptr(), key.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                            positions.data_ptr(), tokens, num_q_heads, key.shape[1], head_dim,
                            query.stride(0), query.stride(1), key.stride(0), key.stride(1))


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
    """silu(gate) * up of the fused gate/up projection (unit column stride): as
    orca_kernels.activations.silu_and_mul_torch."""
    if x.dtype is not torch.float32 or x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"silu_and_mul_cpu takes float32 (T, 2I) with unit column stride, got {x.dtype} "
                         f"{tuple(x.shape)}")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype)
    _function("silu_and_mul_f32")(out.data_ptr(), x.data_ptr(), rows, inter, x.stride(0))
    return out


def write_kv_cpu(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Each token's K/V row (strided views allowed) into its slot, in place: as orca_kernels.kv_cache.write_kv_torch."""
    tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not fit key {tuple(key.shape)} / value "
                         f"{tuple(value.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("the caches must be contiguous and key/value unit-stride along head_dim")
    if slot_mapping.shape != (tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 of shape ({tokens},), got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if not all(t.dtype == torch.float32 for t in (key, value, k_cache, v_cache)):
        raise ValueError("write_kv_cpu takes float32 keys, values and caches")
    slot_mapping = slot_mapping.contiguous()
    _function("write_kv_f32")(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                              slot_mapping.data_ptr(), tokens, num_kv_heads, head_dim, key.stride(0),
                              key.stride(1), value.stride(0), value.stride(1))


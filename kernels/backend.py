"""Picks the kernel implementation the model runner calls: Triton on CUDA, compiled C attention on
CPU (torch for the rest), plain torch elsewhere or where nothing can be compiled."""

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import activations, attention, attention_cpu, kv_cache, norms, rotary


@dataclass(frozen=True)
class KernelOps:
    """The seven kernels a forward pass needs; every pair of implementations shares one signature."""

    write_kv: Callable[..., None]  # (key, value, k_cache, v_cache, slot_mapping), in place
    attention: Callable[..., torch.Tensor]  # (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
    #                                          *, max_query_len, max_seq_len)
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (x, weight, eps, residual=None) -> (out, sum)
    layer_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (x, weight, bias, eps, residual=None) -> (out, sum)
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]  # (T, 2I) -> (T, I)
    gelu_tanh: Callable[[torch.Tensor], torch.Tensor]  # any shape
    apply_rotary: Callable[..., None]  # (query, key, cos, sin, positions), in place


# Each op's torch and Triton implementations side by side: one row per KernelOps field.
_TORCH_AND_TRITON = {
    "write_kv": (kv_cache.write_kv_torch, kv_cache.write_kv_triton),
    "attention": (attention.ragged_attention_torch, attention.ragged_attention_triton),
    "rms_norm": (norms.rms_norm_torch, norms.rms_norm_triton),
    "layer_norm": (norms.layer_norm_torch, norms.layer_norm_triton),
    "silu_and_mul": (activations.silu_and_mul_torch, activations.silu_and_mul_triton),
    "gelu_tanh": (activations.gelu_tanh_torch, activations.gelu_tanh_triton),
    "apply_rotary": (rotary.apply_rotary_torch, rotary.apply_rotary_triton),
}
TORCH_OPS = KernelOps(**{op: torch_op for op, (torch_op, _) in _TORCH_AND_TRITON.items()})
TRITON_OPS = KernelOps(**{op: triton_op for op, (_, triton_op) in _TORCH_AND_TRITON.items()})

# Token-wise ops stay torch on CPU (they already run at matmul speed there); attention is one C call,
# and the tanh GELU torch's fused op.
CPU_OPS = dataclasses.replace(TORCH_OPS, attention=attention_cpu.ragged_attention_cpu,
                              gelu_tanh=activations.gelu_tanh_cpu)


def _triton_interpreting() -> bool:
    # The one environment lookup in kernels/: TRITON_INTERPRET is Triton's own switch, read when the
    # @triton.jit decorators ran, so we ask Triton how it parsed it rather than adding a setting of our own.
    knobs = getattr(attention.triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")  # Triton < 3.4


def get_kernel_ops(name: str, device_type: str, dtype: torch.dtype = torch.float32) -> KernelOps:
    """`name` is "auto" (Triton on cuda, the compiled C attention on cpu where it builds, torch elsewhere),
    "torch", "cpu" or "triton"; `device_type` as torch.device.type; `dtype` the model's."""
    if name not in ("auto", "torch", "cpu", "triton"):
        raise ValueError(f"unknown kernel backend {name!r}; expected 'auto', 'torch', 'cpu' or 'triton'")
    triton_installed = attention.triton is not None
    if name == "cpu" or (name == "auto" and device_type == "cpu"):
        if device_type != "cpu":
            raise ValueError(f"kernel backend 'cpu' runs on cpu, got device {device_type!r}")
        if attention_cpu.available(dtype):
            return CPU_OPS
        if name == "cpu":
            raise ValueError(f"kernel backend 'cpu' needs a C compiler and float32/float64, got {dtype}")
        return TORCH_OPS
    if name == "torch" or (name == "auto" and not (device_type == "cuda" and triton_installed)):
        return TORCH_OPS
    if not triton_installed:
        raise ValueError("kernel backend 'triton' needs the triton package, which is not installed")
    if device_type != "cuda" and not (device_type == "cpu" and _triton_interpreting()):
        raise ValueError(
            f"kernel backend 'triton' runs on cuda, or on cpu only under TRITON_INTERPRET=1 set before triton "
            f"is imported; got device {device_type!r}"
        )
    return TRITON_OPS

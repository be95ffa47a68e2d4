"""Picks the kernel implementation the model runner calls: Triton on CUDA, torch elsewhere."""

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import activations, attention, kv_cache, norms, rotary


@dataclass(frozen=True)
class KernelOps:
    """The seven kernels a forward pass needs; every pair of implementations shares one signature."""

    write_kv: Callable[..., None]  # (key, value, k_cache, v_cache, slot_mapping), in place
    attention: Callable[..., torch.Tensor]  # (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (x, weight, eps, residual=None) -> (out, sum)
    layer_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (x, weight, bias, eps, residual=None) -> (out, sum)
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]  # (T, 2I) -> (T, I)
    gelu_tanh: Callable[[torch.Tensor], torch.Tensor]  # any shape
    apply_rotary: Callable[..., None]  # (query, key, cos, sin, positions), in place


TORCH_OPS = KernelOps(
    write_kv=kv_cache.write_kv_torch,
    attention=attention.ragged_attention_torch,
    rms_norm=norms.rms_norm_torch,
    layer_norm=norms.layer_norm_torch,
    silu_and_mul=activations.silu_and_mul_torch,
    gelu_tanh=activations.gelu_tanh_torch,
    apply_rotary=rotary.apply_rotary_torch,
)

TRITON_OPS = KernelOps(
    write_kv=kv_cache.write_kv_triton,
    attention=attention.ragged_attention_triton,
    rms_norm=norms.rms_norm_triton,
    layer_norm=norms.layer_norm_triton,
    silu_and_mul=activations.silu_and_mul_triton,
    gelu_tanh=activations.gelu_tanh_triton,
    apply_rotary=rotary.apply_rotary_triton,
)


def _triton_interpreting() -> bool:
    # The one environment lookup in kernels/: TRITON_INTERPRET is Triton's own switch, read when the
    # @triton.jit decorators ran, so we ask Triton how it parsed it rather than adding a setting of our own.
    knobs = getattr(attention.triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")  # Triton < 3.4


def get_kernel_ops(name: str, device_type: str) -> KernelOps:
    """`name` is "auto" (Triton on cuda, torch elsewhere), "torch" or "triton"; `device_type` as torch.device.type."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown kernel backend {name!r}; expected 'auto', 'torch' or 'triton'")
    triton_installed = attention.triton is not None
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

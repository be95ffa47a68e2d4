"""Picks the kernel implementation the model runner calls: Triton on CUDA, compiled C attention on
CPU (torch for the rest), plain torch elsewhere or where nothing can be compiled."""

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from orca_kernels import activations, attention, attention_cpu, kv_cache, norms, rotary, token_ops_cpu


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

# On CPU attention is one C call and the tanh GELU torch's fused op; float32 models also get the C
# token ops (RMSNorm, rotary, KV write: one call each where torch dispatched up to fourteen ops). float64
# keeps torch's token ops, op for op as transformers computes them, so the exactness tests stay bitwise.
CPU_OPS = dataclasses.replace(TORCH_OPS, attention=attention_cpu.ragged_attention_cpu,
                              gelu_tanh=activations.gelu_tanh_cpu)
CPU_OPS_FLOAT32 = dataclasses.replace(CPU_OPS, rms_norm=token_ops_cpu.rms_norm_cpu,
                                      apply_rotary=token_ops_cpu.apply_rotary_cpu,
                                      write_kv=token_ops_cpu.write_kv_cpu,
                                      silu_and_mul=token_ops_cpu.silu_and_mul_cpu)
CPU_OP_SETS = (CPU_OPS, CPU_OPS_FLOAT32)


def _triton_interpreting() -> bool:
    # The one environment lookup in kernels/: TRITON_INTERPRET is Triton's own switch, read when the
    # @triton.jit decorators ran, so we ask Triton how it parsed it rather than adding a setting of our own.
    knobs = getattr(attention.triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")  # Triton < 3.4


def get_kernel_ops(name: str, device_type: str, dtype: torch.dtype = torch.float32,
                   fused_token_ops: bool = True) -> KernelOps:
    """`name` is "auto" (Triton on cuda, the compiled C attention on cpu where it builds, torch elsewhere),
    "torch", "cpu" or "triton"; `device_type` as torch.device.type; `dtype` the model's. `fused_token_ops`
    False keeps torch's token-wise ops on the CPU (for a step torch.compile fuses itself)."""
    if name not in ("auto", "torch", "cpu", "triton"):
        raise ValueError(f"unknown kernel backend {name!r}; expected 'auto', 'torch', 'cpu' or 'triton'")
    triton_installed = attention.triton is not None
    if name == "cpu" or (name == "auto" and device_type == "cpu"):
        if device_type != "cpu":
            raise ValueError(f"kernel backend 'cpu' runs on cpu, got device {device_type!r}")
        if attention_cpu.available(dtype):
            fused = fused_token_ops and dtype == torch.float32 and token_ops_cpu.available()
            return CPU_OPS_FLOAT32 if fused else CPU_OPS
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

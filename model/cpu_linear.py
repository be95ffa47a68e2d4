"""The model's linear layers on the CPU through oneDNN, with weights packed once at load time.

torch's `F.linear` runs float32 matmuls through MKL, which on this project's AMD EPYC machines reaches
about 100 GFLOP/s at the row counts an engine sees (64-128); oneDNN, which picks its kernels by
instruction set rather than by vendor, with the weight reordered once into its blocked layout and
called on dense tensors (the op Inductor's weight prepacking uses), reaches 210-230 (measured with
2 threads at the tiny Llama's MLP shape, 256 x 1376). A single row (a lone decode) goes to oneDNN too:
MKL takes its generic `def` matrix-vector kernel on AMD, and in the engine, where each weight comes
from L3 rather than from the last call's cache, single-stream decode ran 20-28% slower through it
(tiny Llama 2.50 -> 1.80 ms/token, tiny GPT-2 2.98-3.63 -> 2.32-2.99, small Llama 34 -> 31-33; one
thread, 2026-12-03). An earlier VM (AVX2 only) had MKL ahead for small weights in cache; that rule
kept them on MKL and held them twice.
Float32 on the CPU only: float64 (the exactness tests) and the plain torch reference path
(`--kernel-backend torch`) keep `F.linear` everywhere. Row-parallel linears (they all-reduce) are left alone.
"""

from __future__ import annotations

import torch
from torch import nn

PACK_LIMIT_BYTES = 2 * 1024**3
"""Above this much linear weight, packing (a second copy of every weight) is not worth the memory."""


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W in oneDNN's packed layout; a drop-in for an nn.Linear on float32 CPU tensors."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # for anyone reading .weight (tied embeddings, checkpoints)
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    weight_bytes = sum(m.weight.numel() * 4 for m in model.modules() if type(m) is nn.Linear)
    return weight_bytes <= PACK_LIMIT_BYTES


@torch.inference_mode()
def pack_linears(model: nn.Module) -> int:
    """Replace every plain nn.Linear under `model` by a PackedLinear; returns how many."""
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
                packed += 1
    return packed

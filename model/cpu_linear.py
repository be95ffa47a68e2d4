"""The model's linear layers on the CPU through oneDNN, with weights packed once at load time.

torch's `F.linear` runs float32 matmuls through MKL, which on this project's AMD EPYC machine reaches
about 100 GFLOP/s at the row counts an engine sees (64-128); oneDNN, which picks its kernels by
instruction set rather than by vendor, with the weight reordered once into its blocked layout and
called on dense tensors (the op Inductor's weight prepacking uses), reaches 210-230 (measured with
2 threads at the tiny Llama's MLP shape, 256 x 1376). For a single row (a lone decode) MKL's
matrix-vector product is faster while the weight is small (up to a few MiB, in cache); a large weight
(the small Llama's 32000 x 768 LM head: 5.9 ms on MKL, 2.6 on oneDNN) and any two or more rows (MKL
took 0.7 ms at 2 rows on the tiny Llama's projections where oneDNN took 0.33, 15.4 vs 3.3 ms on the small
Llama's) go to oneDNN. So small weights are held twice (dense and packed): packing is skipped for models
whose linear weights exceed PACK_LIMIT_BYTES.
Float32 on the CPU only: float64 (the exactness tests) and the plain torch reference path
(`--kernel-backend torch`) keep `F.linear` everywhere. Row-parallel linears (they all-reduce) are left alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACK_LIMIT_BYTES = 2 * 1024**3
"""Above this much linear weight, packing (a second copy of every weight) is not worth the memory."""
DENSE_ROW_MAX_BYTES = 8 * 1024**2
"""A single row runs on the dense weight (MKL's matrix-vector product) when the weight is at most this
big; above it oneDNN's packed weight reads faster (measured at 4096 x 768: 1.19x, 32000 x 768: 2.25x)."""


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W in oneDNN's packed layout; a drop-in for an nn.Linear on float32 CPU tensors."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # dense, for a single row of a small weight (and for anyone reading .weight)
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.dense_single_row = linear.weight.numel() * linear.weight.element_size() <= DENSE_ROW_MAX_BYTES

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        if x.shape[0] == 1 and self.dense_single_row:
            return F.linear(x, self.weight, self.bias)
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

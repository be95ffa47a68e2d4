"""The model's linear layers on the CPU through oneDNN, with weights packed once at load time.

torch's `F.linear` runs float32 matmuls through MKL, which on this project's AMD EPYC machine reaches
about 100 GFLOP/s on one core at the batch sizes an engine sees (64-1024 rows); oneDNN, which picks
its kernels by instruction set rather than vendor, with the weight packed once into its blocked
layout, reaches about 200 (benchmarks/README.md). Packing replaces each plain `nn.Linear` (not the
row-parallel ones, which all-reduce) by torch's own `MkldnnLinear`. Float32 on the CPU only: float64
(the exactness tests) and the plain torch reference path (`--kernel-backend torch`) keep `F.linear`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.mkldnn import MkldnnLinear


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module) -> int:
    """Replace every plain nn.Linear under `model` by a oneDNN one with packed weights; returns how many.
    A weight shared with another module (a tied LM head) is packed as a copy for the linear's use."""
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, MkldnnLinear(child, torch.float32))
                packed += 1
    return packed

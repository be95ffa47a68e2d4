"""Tensor parallelism as a pass over the unmodified model (Megatron-LM's split).

In each layer, the input projections (q/k/v, gate/up, GPT-2's c_attn and c_fc) become
column-parallel: each of the N ranks holds 1/N of the output features, that is 1/N of the
attention heads and of the MLP's columns, and computes them with no communication. The output
projections (o_proj, down_proj, GPT-2's c_proj) become row-parallel: each rank multiplies its
slice of the inputs and one all-reduce sums the partial results; a bias is added once, after
it. Two all-reduces per layer. Embeddings, norms and the LM head stay whole on every rank.

With grouped-query attention and fewer KV heads than ranks, each KV head is replicated on the
N / num_kv_heads ranks whose query heads read it.

`checkpoint_slice` says which part of each checkpoint tensor a rank loads, so a rank reads
only its shard from the safetensors files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.arch import ArchConfig, check_divisible
from model.distributed import ParallelGroups


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W_local^T) + b: the inputs are this rank's slice of the features."""

    def __init__(self, in_features: int, out_features: int, bias: bool, groups: ParallelGroups) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.groups.all_reduce(F.linear(x, self.weight))
        return out + self.bias if self.bias is not None else out


def local_kv_heads(arch: ArchConfig, tp_size: int) -> int:
    return max(1, arch.num_kv_heads // tp_size)


def shard_layers(model: nn.Module, arch: ArchConfig, groups: ParallelGroups) -> None:
    """Replace each layer's projections by this rank's shards (in place, before weights load)."""
    tp = groups.rank.tp_size
    if tp == 1:
        return
    check_divisible(arch, tp)
    start, end = model.layer_range
    layers = model.h if arch.is_gpt2 else model.layers
    for index in range(start, end):
        (_shard_gpt2_block if arch.is_gpt2 else _shard_llama_layer)(layers[index], arch, groups)


def _shard_llama_layer(layer: nn.Module, arch: ArchConfig, groups: ParallelGroups) -> None:
    tp, hd, H = groups.rank.tp_size, arch.head_dim, arch.hidden_size
    attn, mlp = layer.self_attn, layer.mlp
    attn.num_heads, attn.num_kv_heads = arch.num_heads // tp, local_kv_heads(arch, tp)
    attn.q_size, attn.kv_size = attn.num_heads * hd, attn.num_kv_heads * hd
    attn.qkv_proj = nn.Linear(H, attn.q_size + 2 * attn.kv_size, bias=arch.qkv_bias)
    attn.o_proj = RowParallelLinear(attn.q_size, H, bias=False, groups=groups)
    inter = arch.intermediate_size // tp
    mlp.gate_up_proj = nn.Linear(H, 2 * inter, bias=False)
    mlp.down_proj = RowParallelLinear(inter, H, bias=False, groups=groups)


def _shard_gpt2_block(block: nn.Module, arch: ArchConfig, groups: ParallelGroups) -> None:
    tp, H = groups.rank.tp_size, arch.hidden_size
    block.num_heads = arch.num_heads // tp
    local = block.num_heads * arch.head_dim
    block.c_attn = nn.Linear(H, 3 * local)
    block.attn_proj = RowParallelLinear(local, H, bias=True, groups=groups)
    inter = arch.intermediate_size // tp
    block.c_fc = nn.Linear(H, inter)
    block.mlp_proj = RowParallelLinear(inter, H, bias=True, groups=groups)


# ---- which part of each checkpoint tensor a rank loads ------------------------------------

Slicer = Callable[[Any], torch.Tensor]  # takes a safetensors PySafeSlice (or a tensor), returns the shard


def checkpoint_slice(arch: ArchConfig, name: str, shape: list[int], groups: ParallelGroups) -> Slicer | None:
    """How to cut this rank's shard out of checkpoint tensor `name`; None loads it whole."""
    tp, r = groups.rank.tp_size, groups.rank.tp_rank
    if tp == 1:
        return None
    if arch.is_gpt2:
        return _gpt2_slice(name, shape, tp, r)
    hd, nkv = arch.head_dim, arch.num_kv_heads
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias",
                      "mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return _split(0, shape[0], tp, r)
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                      "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
        if nkv >= tp:
            return _split(0, shape[0], tp, r)
        head = r * nkv // tp  # replicated: ranks r with the same head share it
        return _take(0, head * hd, (head + 1) * hd)
    if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
        return _split(1, shape[1], tp, r)
    return None


def _gpt2_slice(name: str, shape: list[int], tp: int, r: int) -> Slicer | None:
    # GPT-2 stores Conv1D weights as (in, out): output features are the last dimension.
    last = len(shape) - 1
    if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
        third = shape[last] // 3  # [q | k | v], each split by heads

        def qkv(source: Any) -> torch.Tensor:
            parts = [_take(last, part * third + r * third // tp, part * third + (r + 1) * third // tp)(source)
                     for part in range(3)]
            return torch.cat(parts, dim=last)
        return qkv
    if name.endswith(("mlp.c_fc.weight", "mlp.c_fc.bias")):
        return _split(last, shape[last], tp, r)
    if name.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")):
        return _split(0, shape[0], tp, r)
    return None


def _split(dim: int, size: int, tp: int, r: int) -> Slicer:
    return _take(dim, r * size // tp, (r + 1) * size // tp)


def _take(dim: int, start: int, end: int) -> Slicer:
    def take(source: Any) -> torch.Tensor:
        return source[start:end] if dim == 0 else source[:, start:end]
    return take

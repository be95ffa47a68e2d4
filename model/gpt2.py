"""GPT-2 with selective batching: learned positions, LayerNorm, GeLU (tanh), fused c_attn.

HF stores GPT-2's projections as Conv1D with (in, out) weights; they are transposed once
at load time so every projection is a plain nn.Linear.
"""

from __future__ import annotations

import torch
from torch import nn

from orca_kernels.backend import KernelOps
from model.arch import ArchConfig
from model.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


class GPT2Block(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        H = arch.hidden_size
        self.num_heads, self.head_dim = arch.num_heads, arch.head_dim
        self.eps = arch.norm_eps
        self.ln_1 = nn.LayerNorm(H, eps=arch.norm_eps)
        self.c_attn = nn.Linear(H, 3 * H)
        self.attn_proj = nn.Linear(H, H)
        self.ln_2 = nn.LayerNorm(H, eps=arch.norm_eps)
        self.c_fc = nn.Linear(H, arch.intermediate_size)
        self.mlp_proj = nn.Linear(arch.intermediate_size, H)
        self.scale = self.head_dim ** -0.5

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
                meta: AttentionMetadata, ops: KernelOps) -> tuple[torch.Tensor, torch.Tensor]:
        T, H = h.shape
        x, residual = ops.layer_norm(h, self.ln_1.weight, self.ln_1.bias, self.eps, residual)
        q, k, v = self.c_attn(x).view(T, 3, self.num_heads, self.head_dim).unbind(1)  # each (T, nh, hd)
        ops.write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        attn = ops.attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens,
                             meta.query_start_loc, self.scale,
                             max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)
        h = self.attn_proj(attn.reshape(T, -1))  # H, or this rank's share of it under tensor parallelism
        x, residual = ops.layer_norm(h, self.ln_2.weight, self.ln_2.bias, self.eps, residual)
        return self.mlp_proj(ops.gelu_tanh(self.c_fc(x))), residual


class GPT2LMHeadModel(nn.Module):
    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.wte = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.wpe = nn.Embedding(arch.max_position_embeddings, arch.hidden_size)
        self.h = nn.ModuleList(GPT2Block(arch) for _ in range(arch.num_layers))
        self.ln_f = nn.LayerNorm(arch.hidden_size, eps=arch.norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.layer_range = (0, arch.num_layers)  # a pipeline stage narrows it (model/pipeline.py)

    def finish_loading(self) -> None:
        if self.arch.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, ops: KernelOps) -> torch.Tensor:
        h, residual = self.run_layers(self.embed(input_ids, positions), None, positions, kv_caches, meta, ops)
        return self.final_norm(h, residual, ops)

    # A pipeline stage runs a part of forward(): the first embeds, each runs its layers, the last normalizes.

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids) + self.wpe(positions)  # (T, H)

    def run_layers(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   kv_caches: list[KVCache], meta: AttentionMetadata,
                   ops: KernelOps) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks in `layer_range`; kv_caches[i] belongs to the range's i-th block."""
        start, end = self.layer_range
        for index, kv_cache in zip(range(start, end), kv_caches, strict=True):
            h, residual = self.h[index](h, residual, kv_cache, meta, ops)
        return h, residual

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        h, _ = ops.layer_norm(h, self.ln_f.weight, self.ln_f.bias, self.arch.norm_eps, residual)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)  # (N, V)

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return  # causal-mask buffers of old checkpoints
        parts = name.split(".")
        if parts[0] == "h":
            self._load_block_weight(self.h[int(parts[1])], ".".join(parts[2:]), tensor)
            return
        if name not in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"):
            raise ValueError(f"unexpected weight {name!r} in a gpt2 checkpoint")
        module_name, kind = name.split(".")
        getattr(getattr(self, module_name), kind).data.copy_(tensor)

    def _load_block_weight(self, block: GPT2Block, name: str, tensor: torch.Tensor) -> None:
        conv1d = {"attn.c_attn": block.c_attn, "attn.c_proj": block.attn_proj,
                  "mlp.c_fc": block.c_fc, "mlp.c_proj": block.mlp_proj}
        module_name, kind = name.rsplit(".", 1)
        if module_name in conv1d:
            param = getattr(conv1d[module_name], kind)
            param.data.copy_(tensor.t() if kind == "weight" else tensor)
        elif module_name in ("ln_1", "ln_2"):
            getattr(getattr(block, module_name), kind).data.copy_(tensor)
        else:
            raise ValueError(f"unexpected block weight {name!r} in a gpt2 checkpoint")

"""Llama-family decoder (Llama, Mistral, Qwen2) with selective batching.

All tokens of all requests of an iteration travel as one flat (T, H) tensor through the
token-wise ops (norms, projections, MLP); only attention looks at request boundaries,
through `AttentionMetadata` and the KV cache. Weight names follow the HF checkpoint, with
q/k/v and gate/up fused at load time (one matmul each instead of three and two).
"""

from __future__ import annotations

import torch
from torch import nn

from orca_kernels.backend import KernelOps
from model.arch import ArchConfig
from model.metadata import AttentionMetadata
from model.rope import cos_sin_tables

KVCache = tuple[torch.Tensor, torch.Tensor]  # (num_blocks, block_size, nkv, hd) each


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: KVCache, meta: AttentionMetadata, ops: KernelOps) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q + 2kv)
        q = qkv[:, :self.q_size].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        ops.apply_rotary(q, k, rope[0], rope[1], positions)
        ops.write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        out = ops.attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, self.scale,
                            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)  # (T, nh, hd)
        return self.o_proj(out.reshape(T, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.eps = arch.norm_eps
        self.input_layernorm = nn.Parameter(torch.ones(arch.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(arch.hidden_size))
        self.self_attn = LlamaAttention(arch)
        self.mlp = LlamaMLP(arch)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache, meta: AttentionMetadata,
                ops: KernelOps) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = ops.rms_norm(h, self.input_layernorm, self.eps, residual)
        h = self.self_attn(x, positions, rope, kv_cache, meta, ops)
        x, residual = ops.rms_norm(h, self.post_attention_layernorm, self.eps, residual)
        return self.mlp(x, ops), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.max_positions = max_positions
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.layer_range = (0, arch.num_layers)  # a pipeline stage narrows it (model/pipeline.py)

    def finish_loading(self) -> None:
        """Called once weights are in place: tie the head and build the RoPE tables."""
        if self.arch.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight
        weight = next(self.parameters())
        self.rope = cos_sin_tables(self.arch, self.max_positions, weight.dtype, weight.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, ops: KernelOps) -> torch.Tensor:
        h, residual = self.run_layers(self.embed(input_ids, positions), None, positions, kv_caches, meta, ops)
        return self.final_norm(h, residual, ops)

    # A pipeline stage runs a part of forward(): the first embeds, each runs its layers, the last normalizes.

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # (T, H)

    def run_layers(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   kv_caches: list[KVCache], meta: AttentionMetadata,
                   ops: KernelOps) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers in `layer_range`; kv_caches[i] belongs to the range's i-th layer."""
        assert self.rope is not None, "finish_loading() was not called"
        start, end = self.layer_range
        for index, kv_cache in zip(range(start, end), kv_caches, strict=True):
            h, residual = self.layers[index](h, residual, positions, self.rope, kv_cache, meta, ops)
        return h, residual

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        h, _ = ops.rms_norm(h, self.norm, self.arch.norm_eps, residual)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)  # (N, V)

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor into place, fusing q/k/v and gate/up on the way."""
        name = name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):
            return
        parts = name.split(".")
        if parts[0] == "layers":
            self._load_layer_weight(self.layers[int(parts[1])], ".".join(parts[2:]), tensor)
        elif name == "embed_tokens.weight":
            self.embed_tokens.weight.data.copy_(tensor)
        elif name == "norm.weight":
            self.norm.data.copy_(tensor)
        elif name == "lm_head.weight":
            self.lm_head.weight.data.copy_(tensor)
        else:
            raise ValueError(f"unexpected weight {name!r} in a {self.arch.architecture} checkpoint")

    def _load_layer_weight(self, layer: LlamaDecoderLayer, name: str, tensor: torch.Tensor) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        q, kv, inter = attn.q_size, attn.kv_size, mlp.down_proj.in_features
        fused = {
            "self_attn.q_proj": (attn.qkv_proj, 0, q),
            "self_attn.k_proj": (attn.qkv_proj, q, q + kv),
            "self_attn.v_proj": (attn.qkv_proj, q + kv, q + 2 * kv),
            "mlp.gate_proj": (mlp.gate_up_proj, 0, inter),
            "mlp.up_proj": (mlp.gate_up_proj, inter, 2 * inter),
        }
        module_name, kind = name.rsplit(".", 1)
        if module_name in fused:
            module, start, end = fused[module_name]
            getattr(module, kind).data[start:end].copy_(tensor)
        elif name == "self_attn.o_proj.weight":
            attn.o_proj.weight.data.copy_(tensor)
        elif name == "mlp.down_proj.weight":
            mlp.down_proj.weight.data.copy_(tensor)
        elif name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            getattr(layer, name.split(".")[0]).data.copy_(tensor)
        else:
            raise ValueError(f"unexpected layer weight {name!r} in a {self.arch.architecture} checkpoint")

"""Small random Hugging Face checkpoints of each supported architecture, made with transformers."""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]
"""The architectures the model runner supports, each made by `make_checkpoint`."""


def make_checkpoint(arch: str, out: Path, *, sharded: bool = False) -> Path:
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    common = dict(vocab_size=512, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
    if arch == "llama":  # GQA 4:2, head_dim 24 (not a power of two)
        config = LlamaConfig(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, **common)
        cls = LlamaForCausalLM
    elif arch == "qwen2":  # attention bias, tied embeddings, MQA
        config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, tie_word_embeddings=True, **common)
        cls = Qwen2ForCausalLM
    elif arch == "mistral":  # explicit head_dim != hidden / heads; sliding window beyond the context
        config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, sliding_window=4096, **common)
        cls = MistralForCausalLM
    elif arch == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=512,
                            bos_token_id=None, eos_token_id=None)
        cls = GPT2LMHeadModel
    else:
        raise ValueError(arch)
    config.architectures = [cls.__name__]
    torch.manual_seed(1234)
    model = cls(config)
    with torch.no_grad():  # larger weights than HF's init: sharper logits, fewer near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="100KB" if sharded else "5GB")
    return out

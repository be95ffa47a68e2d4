"""What the runner needs to know about a checkpoint, read from its config.json.

Supports the Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) and
GPT2LMHeadModel; anything else is a clear ValueError, not a wrong answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.parallel import ParallelRank

LLAMA_FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
GPT2_FAMILY = {"GPT2LMHeadModel": "gpt2"}
SUPPORTED = {**LLAMA_FAMILY, **GPT2_FAMILY}


@dataclass(frozen=True)
class ArchConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "gpt2"
    vocab_size: int
    hidden_size: int  # H
    num_layers: int
    num_heads: int  # nh
    num_kv_heads: int  # nkv; < nh is GQA, 1 is MQA
    head_dim: int  # hd; not always H / nh
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 and GPT-2 have biases on the attention input projection
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. {"rope_type": "llama3", ...}
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def is_gpt2(self) -> bool:
        return self.architecture == "gpt2"

    @property
    def context_len(self) -> int:
        """Longest context served exactly: Mistral's sliding window is not implemented, so
        the context stops where the window would start to matter."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def load_arch_config(model_dir: str | Path) -> ArchConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} is not a Hugging Face checkpoint directory: no config.json")
    raw = json.loads(path.read_text())
    archs = raw.get("architectures") or []
    name = next((a for a in archs if a in SUPPORTED), None)
    if name is None:
        raise ValueError(f"architectures {archs} in {path} are not supported; supported: {sorted(SUPPORTED)}")
    if name in GPT2_FAMILY:
        return _gpt2(raw)
    return _llama(raw, LLAMA_FAMILY[name])


def _eos_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _llama(raw: dict, family: str) -> ArchConfig:
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope_type {rope_type!r} is not supported (default and llama3 are)")
    sliding = raw.get("sliding_window")
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        sliding = None
    return ArchConfig(
        architecture=family,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        intermediate_size=raw["intermediate_size"],
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        qkv_bias=family == "qwen2" or raw.get("attention_bias", False),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
        rope_scaling=scaling if rope_type == "llama3" else None,
        sliding_window=sliding,
        eos_token_ids=_eos_ids(raw),
        bos_token_id=raw.get("bos_token_id"),
    )


def _gpt2(raw: dict) -> ArchConfig:
    hidden, heads = raw["n_embd"], raw["n_head"]
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"GPT-2 activation {act!r} is not supported (gelu_new is)")
    if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("reorder_and_upcast_attn"):
        raise ValueError("GPT-2 scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    return ArchConfig(
        architecture="gpt2",
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        num_layers=raw["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=raw.get("n_inner") or 4 * hidden,
        max_position_embeddings=raw.get("n_positions", 1024),
        norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        qkv_bias=True,
        eos_token_ids=_eos_ids(raw),
        bos_token_id=raw.get("bos_token_id"),
    )


def check_divisible(arch: ArchConfig, tp_size: int) -> None:
    """ValueError unless `tp_size` ranks can split the heads, KV heads and MLP columns (model/tensor_parallel.py)."""
    problems = []
    if arch.num_heads % tp_size:
        problems.append(f"{arch.num_heads} attention heads")
    nkv = arch.num_kv_heads
    if nkv % tp_size and tp_size % nkv:
        problems.append(f"{nkv} KV heads (need a multiple or a divisor of the TP size)")
    if arch.intermediate_size % tp_size:
        problems.append(f"intermediate size {arch.intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {', '.join(problems)}")


def check_split(arch: ArchConfig, tp_size: int, pp_size: int) -> None:
    """Fail before starting any worker if the model cannot be split this way: arithmetic only, so the
    engine master (the control plane, no torch) checks it too."""
    check_divisible(arch, tp_size)
    ParallelRank(pp_size=pp_size).layer_range(arch.num_layers)


def eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (Llama 3 lists several)."""
    ids = list(load_arch_config(model_dir).eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        ids += [i for i in _eos_ids(json.loads(gen.read_text())) if i not in ids]
    return tuple(ids)


def resolve_max_model_len(model_dir: str | Path, wanted: int | None) -> int:
    context = load_arch_config(model_dir).context_len
    if wanted is not None and wanted > context:
        raise ValueError(f"max_model_len={wanted} exceeds the model's context of {context} tokens")
    return wanted or context

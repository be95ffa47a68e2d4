"""Build a model from a Hugging Face checkpoint directory: config.json + safetensors
(one `model.safetensors`, or shards listed in `model.safetensors.index.json`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from model.arch import ArchConfig, load_arch_config
from model.gpt2 import GPT2LMHeadModel
from model.llama import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return DTYPES[name]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    return found


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str,
               max_positions: int | None = None) -> tuple[nn.Module, ArchConfig]:
    model_dir = Path(model_dir)
    arch = load_arch_config(model_dir)
    positions = max_positions or arch.context_len
    cls = GPT2LMHeadModel if arch.is_gpt2 else LlamaForCausalLM
    with torch.device(device):
        model = cls(arch, positions).to(dtype)
    for param in model.parameters():
        param.data.fill_(float("nan"))  # any weight the checkpoint lacks shows up below
    for name, tensor in iter_weights(model_dir):
        try:
            model.load_weight(name, tensor.to(dtype))
        except RuntimeError as exc:  # shape mismatch from copy_
            raise ValueError(f"weight {name!r} of shape {tuple(tensor.shape)} does not fit the model: {exc}") from exc
    model.finish_loading()
    missing = [name for name, p in model.named_parameters() if torch.isnan(p).any()]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(missing[:8])}")
    return model.eval(), arch

"""Build a model from a Hugging Face checkpoint directory: config.json + safetensors
(one `model.safetensors`, or shards listed in `model.safetensors.index.json`)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from model.arch import ArchConfig, load_arch_config
from model.distributed import ParallelGroups
from model.gpt2 import GPT2LMHeadModel
from model.llama import LlamaForCausalLM
from model.pipeline import is_local_weight, keep_stage
from model.tensor_parallel import checkpoint_slice, shard_layers

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


def iter_weights(model_dir: Path, arch: ArchConfig, groups: ParallelGroups,
                 wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors `wanted`, each cut to this rank's tensor-parallel shard as it is read."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not wanted(name):
                    continue
                source = f.get_slice(name)
                cut = checkpoint_slice(arch, name, list(source.get_shape()), groups)
                yield name, (cut(source) if cut is not None else f.get_tensor(name))


@contextmanager
def _no_random_init() -> Iterator[None]:
    """Module constructors initialize their weights at random, which the checkpoint overwrites
    anyway; on the meta device that init even imports torch's compiler stack (seconds)."""
    names = ("uniform_", "normal_", "kaiming_uniform_", "trunc_normal_", "constant_", "ones_", "zeros_")
    saved = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _materialize(model: nn.Module, dtype: torch.dtype, device: str) -> None:
    """Real (uninitialized) storage for each meta parameter. Not `to_empty`: on meta tensors it
    goes through torch's reference implementations, which import sympy (seconds per process)."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                                                    requires_grad=False)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str, max_positions: int | None = None,
               groups: ParallelGroups | None = None) -> tuple[nn.Module, ArchConfig]:
    """The model, or with `groups` this worker's part of it: its pipeline stage's layers, each
    sharded for tensor parallelism. Only that part is allocated and read from disk."""
    model_dir = Path(model_dir)
    groups = groups or ParallelGroups()
    arch = load_arch_config(model_dir)
    positions = max_positions or arch.context_len
    cls = GPT2LMHeadModel if arch.is_gpt2 else LlamaForCausalLM
    with torch.device("meta"), _no_random_init():
        model = cls(arch, positions)
        keep_stage(model, arch, groups.rank)
        shard_layers(model, arch, groups)
    _materialize(model, dtype, device)
    for param in model.parameters():
        param.data.fill_(float("nan"))  # any weight the checkpoint lacks shows up below
    for name, tensor in iter_weights(model_dir, arch, groups, lambda n: is_local_weight(model, arch, n)):
        try:
            model.load_weight(name, tensor.to(dtype))
        except RuntimeError as exc:  # shape mismatch from copy_
            raise ValueError(f"weight {name!r} of shape {tuple(tensor.shape)} does not fit the model: {exc}") from exc
    model.finish_loading()
    missing = [name for name, p in model.named_parameters() if torch.isnan(p).any()]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(missing[:8])}")
    return model.eval(), arch

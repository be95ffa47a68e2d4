"""Pipeline parallelism as a pass over the unmodified model: keep one stage's part of it.

A stage keeps its contiguous slice of the layers (and allocates KV for those only); the first
stage also keeps the embeddings, the last the final norm and the LM head (and the embeddings
too when the head is tied to them). Everything else is dropped before weights are allocated,
and `is_local_weight` tells the loader which checkpoint tensors to skip.
"""

from __future__ import annotations

from torch import nn

from model.arch import ArchConfig
from shared.parallel import ParallelRank

# top-level modules by role, per family
FIRST_STAGE = {"llama": ("embed_tokens",), "gpt2": ("wte", "wpe")}
LAST_STAGE = {"llama": ("norm", "lm_head"), "gpt2": ("ln_f", "lm_head")}
TIED_EMBEDDING = {"llama": "embed_tokens", "gpt2": "wte"}
LAYERS = {"llama": "layers", "gpt2": "h"}


def family(arch: ArchConfig) -> str:
    return "gpt2" if arch.is_gpt2 else "llama"


def keep_stage(model: nn.Module, arch: ArchConfig, rank: ParallelRank) -> None:
    """Drop what this stage does not run (in place, before weights are allocated)."""
    if rank.pp_size == 1:
        return
    start, end = rank.layer_range(arch.num_layers)
    model.layer_range = (start, end)
    layers = getattr(model, LAYERS[family(arch)])
    for index in range(arch.num_layers):
        if not start <= index < end:
            layers[index] = nn.Identity()  # keeps indices (and checkpoint names) aligned
    for name in _dropped_modules(arch, rank):
        setattr(model, name, None)


def _dropped_modules(arch: ArchConfig, rank: ParallelRank) -> list[str]:
    kind = family(arch)
    keep: set[str] = set()
    if rank.is_first_stage:
        keep.update(FIRST_STAGE[kind])
    if rank.is_last_stage:
        keep.update(LAST_STAGE[kind])
        if arch.tie_word_embeddings:
            keep.add(TIED_EMBEDDING[kind])
    return [name for name in FIRST_STAGE[kind] + LAST_STAGE[kind] if name not in keep]


def is_local_weight(model: nn.Module, arch: ArchConfig, name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to a module this stage kept."""
    parts = name.removeprefix("model.").removeprefix("transformer.").split(".")
    if parts[0] == LAYERS[family(arch)] and len(parts) > 1 and parts[1].isdigit():
        start, end = model.layer_range
        return start <= int(parts[1]) < end
    if parts[0] in FIRST_STAGE[family(arch)] + LAST_STAGE[family(arch)]:
        return getattr(model, parts[0]) is not None
    return True

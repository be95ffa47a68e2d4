"""Rotary position embedding tables, computed as transformers computes them (float32, then
cast to the model dtype) so float64 runs match it exactly."""

from __future__ import annotations

import math

import torch

from model.arch import ArchConfig


def inv_frequencies(arch: ArchConfig) -> torch.Tensor:
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # (hd/2,)
    if arch.rope_scaling is not None:
        inv_freq = _llama3_scaling(inv_freq, arch.rope_scaling)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_tables(arch: ArchConfig, max_positions: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Return cos, sin of shape (max_positions, hd/2) in `dtype`."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_frequencies(arch)[None, :]  # (P, hd/2), float32 like HF
    return freqs.cos().to(dtype=dtype, device=device), freqs.sin().to(dtype=dtype, device=device)

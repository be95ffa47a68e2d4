"""Rotary embedding, NeoX/HF rotate_half style, in place on strided views of a fused qkv tensor."""

import pytest
import torch

from orca_kernels.rotary import apply_rotary_torch, apply_rotary_triton

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _case(head_dim: int, dtype: torch.dtype, num_heads: int = 4, num_kv_heads: int = 2, num_tokens: int = 6):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(64, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (max_positions, hd/2)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen)
    return qkv, angles.cos().to(dtype), angles.sin().to(dtype), positions, num_heads, num_kv_heads


def _split(qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    return qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]


def test_torch_formula():
    qkv, cos, sin, positions, nh, nkv = _case(64, torch.float64)
    original = qkv.clone()
    apply_rotary_torch(*_split(qkv, nh, nkv), cos, sin, positions)
    x = original[:, : nh + nkv]
    x1, x2 = x[..., :32], x[..., 32:]
    c, s = cos[positions][:, None], sin[positions][:, None]
    assert torch.equal(qkv[:, : nh + nkv], torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
    assert torch.equal(qkv[:, nh + nkv :], original[:, nh + nkv :])  # values untouched


@pytest.mark.triton
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matches_torch(head_dim, dtype):
    qkv, cos, sin, positions, nh, nkv = _case(head_dim, dtype)
    expected = qkv.clone()
    apply_rotary_torch(*_split(expected, nh, nkv), cos, sin, positions)
    apply_rotary_triton(*_split(qkv, nh, nkv), cos, sin, positions)
    torch.testing.assert_close(qkv, expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.triton
def test_triton_many_heads():
    """More heads than fit in one program's tile."""
    qkv, cos, sin, positions, nh, nkv = _case(256, torch.float32, num_heads=40, num_kv_heads=8, num_tokens=2)
    expected = qkv.clone()
    apply_rotary_torch(*_split(expected, nh, nkv), cos, sin, positions)
    apply_rotary_triton(*_split(qkv, nh, nkv), cos, sin, positions)
    torch.testing.assert_close(qkv, expected, atol=1e-5, rtol=1e-5)

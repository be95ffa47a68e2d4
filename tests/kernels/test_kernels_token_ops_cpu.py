"""The compiled CPU token ops (kernels/orca_kernels/csrc/token_ops.c) against their torch references."""

from __future__ import annotations

import pytest
import torch

from orca_kernels import activations, kv_cache, norms, rotary, token_ops_cpu

pytestmark = pytest.mark.skipif(not token_ops_cpu.available(), reason="no C compiler")

TOKENS = [0, 1, 7, 300]  # 300 rows split across threads


def fused_qkv(tokens: int, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64):
    """Query, key and value as the model sees them: strided views of one fused projection."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size)
    return (qkv, qkv[:, :q_size].view(tokens, num_heads, head_dim),
            qkv[:, q_size:q_size + kv_size].view(tokens, num_kv_heads, head_dim),
            qkv[:, q_size + kv_size:].view(tokens, num_kv_heads, head_dim))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(tokens, with_residual):
    torch.manual_seed(tokens)
    x, weight = torch.randn(tokens, 320), torch.randn(320)
    residual = torch.randn(tokens, 320) if with_residual else None
    want_out, want_sum = norms.rms_norm_torch(x, weight, 1e-5, residual)
    out, s = token_ops_cpu.rms_norm_cpu(x, weight, 1e-5, residual)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(s, want_sum)  # the residual sum is one add, exact
    if not with_residual:
        assert s is x


@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_matches_torch_on_fused_views(tokens):
    torch.manual_seed(tokens)
    qkv, q, k, _ = fused_qkv(tokens)
    cos, sin = torch.randn(512, 32), torch.randn(512, 32)
    positions = torch.randint(0, 512, (tokens,))
    want = qkv.clone()
    rotary.apply_rotary_torch(want[:, :256].view(tokens, 4, 64), want[:, 256:384].view(tokens, 2, 64), cos, sin,
                              positions)
    token_ops_cpu.apply_rotary_cpu(q, k, cos, sin, positions)
    torch.testing.assert_close(qkv, want, rtol=1e-6, atol=1e-6)  # value columns untouched too


@pytest.mark.parametrize("tokens", TOKENS)
def test_write_kv_matches_torch_into_scattered_slots(tokens):
    torch.manual_seed(tokens)
    _, _, k, v = fused_qkv(tokens)
    slots = torch.randperm(64 * 16)[:tokens]
    caches = [torch.zeros(64, 16, 2, 64) for _ in range(4)]
    kv_cache.write_kv_torch(k, v, caches[0], caches[1], slots)
    token_ops_cpu.write_kv_cpu(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_matches_torch(tokens):
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 2 * 688) * 6  # gates well past the exp's range reduction, both signs
    x[:, :4] = torch.tensor([0.0, -0.0, 100.0, -100.0])
    torch.testing.assert_close(token_ops_cpu.silu_and_mul_cpu(x), activations.silu_and_mul_torch(x),
                               rtol=1e-6, atol=1e-6)


def test_silu_and_mul_reads_a_strided_projection():
    wide = torch.randn(5, 2 * 96 + 8)  # rows of a wider buffer: row stride 200, columns 0..191
    x = wide[:, :2 * 96]
    torch.testing.assert_close(token_ops_cpu.silu_and_mul_cpu(x), activations.silu_and_mul_torch(x),
                               rtol=1e-6, atol=1e-6)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unit column stride"):
        token_ops_cpu.silu_and_mul_cpu(torch.randn(4, 6).t())
    with pytest.raises(ValueError, match="float32"):
        token_ops_cpu.rms_norm_cpu(torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6)
    _, q, k, v = fused_qkv(3)
    with pytest.raises(ValueError, match="cos/sin"):
        token_ops_cpu.apply_rotary_cpu(q, k, torch.randn(16, 8), torch.randn(16, 8), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping"):
        token_ops_cpu.write_kv_cpu(k, v, torch.zeros(4, 4, 2, 64), torch.zeros(4, 4, 2, 64),
                                   torch.zeros(3, dtype=torch.int32))

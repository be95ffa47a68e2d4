"""write_kv: scatter of new K/V rows into cache slots."""

import pytest
import torch

from orca_kernels.kv_cache import write_kv_torch, write_kv_triton



def _case(block_size: int, head_dim: int, dtype: torch.dtype, num_tokens: int = 11, num_kv_heads: int = 2):
    gen = torch.Generator().manual_seed(0)
    num_blocks = 16
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)  # fused projection
    key, value = qkv[:, 4 : 4 + num_kv_heads], qkv[:, 4 + num_kv_heads :]  # strided views, as the runner has
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    return key, value, k_cache, v_cache, slots


def _expected(key, value, k_cache, v_cache, slots):
    k, v = k_cache.clone(), v_cache.clone()
    k.view(-1, *k.shape[2:])[slots] = key
    v.view(-1, *v.shape[2:])[slots] = value
    return k, v


@pytest.mark.parametrize("block_size", [1, 16])
def test_torch_writes_slots(block_size):
    key, value, k_cache, v_cache, slots = _case(block_size, 64, torch.float32)
    k_exp, v_exp = _expected(key, value, k_cache, v_cache, slots)
    write_kv_torch(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)


@pytest.mark.triton
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matches_torch(block_size, head_dim, dtype):
    key, value, k_cache, v_cache, slots = _case(block_size, head_dim, dtype)
    k_exp, v_exp = _expected(key, value, k_cache, v_cache, slots)
    write_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)


def test_rejects_int32_slots():
    key, value, k_cache, v_cache, slots = _case(16, 64, torch.float32)
    with pytest.raises(ValueError, match="int64"):
        write_kv_torch(key, value, k_cache, v_cache, slots.int())

"""Writing this iteration's keys and values into the paged KV cache.

The cache of one layer is two tensors `(num_blocks, block_size, num_kv_heads, head_dim)`; slot
`s = block_id * block_size + offset_in_block` names one token's row. The model runner computes one slot per
new token (`slot_mapping`) and calls `write_kv` before attention reads the cache.
"""

import torch

try:  # Triton is optional: the torch path must import on machines without it.
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def _check_write_kv_args(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key/value must be (T, num_kv_heads, head_dim), got {tuple(key.shape)}, {tuple(value.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not fit key shape {tuple(key.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 of shape ({key.shape[0]},), "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise ValueError(f"key dtype {key.dtype} does not match cache dtype {k_cache.dtype}")


def write_kv_torch(
    key: torch.Tensor,  # (T, nkv, hd)
    value: torch.Tensor,  # (T, nkv, hd)
    k_cache: torch.Tensor,  # (num_blocks, block_size, nkv, hd)
    v_cache: torch.Tensor,  # (num_blocks, block_size, nkv, hd)
    slot_mapping: torch.Tensor,  # (T,) int64
) -> None:
    """Reference and CPU path: scatter each token's K/V row into its slot, in place."""
    _check_write_kv_args(key, value, k_cache, v_cache, slot_mapping)
    num_kv_heads, head_dim = key.shape[1:]
    # index_copy_ accepts strided sources, so key/value may be views of a fused qkv tensor.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        key_ptr,  # (T, nkv, hd) new keys, any token/head strides, unit dim stride
        value_ptr,  # (T, nkv, hd) new values, same layout rules as key
        k_cache_ptr,  # (num_blocks * block_size, nkv, hd) contiguous key cache seen as slots
        v_cache_ptr,  # (num_blocks * block_size, nkv, hd) contiguous value cache seen as slots
        slot_mapping_ptr,  # (T,) int64 destination slot of each token
        stride_kt,  # key stride between tokens
        stride_kh,  # key stride between heads
        stride_vt,  # value stride between tokens
        stride_vh,  # value stride between heads
        stride_cs,  # cache stride between slots (= nkv * hd)
        stride_ch,  # cache stride between heads (= hd)
        HEAD_DIM: tl.constexpr,  # real head size
        BLOCK_D: tl.constexpr,  # head size rounded up to a power of two
    ):
        # One program copies one (token, kv head) row of K and of V.
        token = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(slot_mapping_ptr + token)  # int64, so slot * stride cannot overflow
        offs_d = tl.arange(0, BLOCK_D)
        mask = offs_d < HEAD_DIM
        k = tl.load(key_ptr + token.to(tl.int64) * stride_kt + head * stride_kh + offs_d, mask=mask)
        v = tl.load(value_ptr + token.to(tl.int64) * stride_vt + head * stride_vh + offs_d, mask=mask)
        dst = slot * stride_cs + head * stride_ch + offs_d
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Triton version of `write_kv_torch` (same arguments): one program per (token, kv head)."""
    if triton is None:
        raise RuntimeError("write_kv_triton needs triton, which is not installed")
    _check_write_kv_args(key, value, k_cache, v_cache, slot_mapping)
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value need a unit stride along head_dim")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip

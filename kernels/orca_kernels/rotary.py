"""Rotary position embedding, NeoX/HF style (`rotate_half`), applied to query and key in place.

For each head, with x1 = x[:hd/2], x2 = x[hd/2:], c = cos[pos], s = sin[pos]:
x1' = x1 * c - x2 * s and x2' = x2 * c + x1 * s. The runner precomputes cos/sin `(max_positions, hd/2)`.
"""

import torch

try:  # Triton is optional: the torch path must import on machines without it.
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def _rotate_torch(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:  # x (T, n, hd), c/s (T, 1, hd/2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    # Same op order as HF's `q * cos + rotate_half(q) * sin`, so float64 matches bit for bit.
    new_x1 = x1 * c - x2 * s
    new_x2 = x2 * c + x1 * s
    x1.copy_(new_x1)
    x2.copy_(new_x2)


def _check_rotary_args(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> None:
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(f"query (T, nh, hd) and key (T, nkv, hd) disagree: {tuple(query.shape)}, {tuple(key.shape)}")
    head_dim = query.shape[2]
    if head_dim % 2 != 0 or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim // 2:
        raise ValueError(f"cos/sin must be (max_positions, {head_dim // 2}), got {tuple(cos.shape)}")
    if positions.shape != (query.shape[0],) or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be int64 of shape ({query.shape[0]},), got {positions.dtype} {tuple(positions.shape)}"
        )


def apply_rotary_torch(
    query: torch.Tensor,  # (T, nh, hd), may be a strided view
    key: torch.Tensor,  # (T, nkv, hd), may be a strided view
    cos: torch.Tensor,  # (max_positions, hd/2)
    sin: torch.Tensor,  # (max_positions, hd/2)
    positions: torch.Tensor,  # (T,) int64
) -> None:
    """Reference and CPU path: compute the rotation, then copy it back into query and key."""
    _check_rotary_args(query, key, cos, sin, positions)
    c = cos[positions].unsqueeze(1)  # (T, 1, hd/2)
    s = sin[positions].unsqueeze(1)  # (T, 1, hd/2)
    _rotate_torch(query, c, s)
    _rotate_torch(key, c, s)


if triton is not None:

    @triton.jit
    def _rotary_kernel(
        x_ptr,  # (T, n_heads, hd) query or key, rotated in place; unit stride along hd
        cos_ptr,  # (max_positions, hd/2) cosines
        sin_ptr,  # (max_positions, hd/2) sines
        positions_ptr,  # (T,) int64 position of each token
        stride_xt,  # x stride between tokens
        stride_xh,  # x stride between heads
        stride_cos,  # row stride of cos
        stride_sin,  # row stride of sin
        n_heads,  # heads in x
        HALF: tl.constexpr,  # hd / 2
        BLOCK_H: tl.constexpr,  # heads per program
        BLOCK_D: tl.constexpr,  # HALF rounded up to a power of two
    ):
        token = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
        offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
        d_mask = offs_d < HALF
        pos = tl.load(positions_ptr + token)
        c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        mask = (heads[:, None] < n_heads) & d_mask[None, :]
        x1_ptrs = x_ptr + token * stride_xt + heads[:, None] * stride_xh + offs_d[None, :]  # (BLOCK_H, BLOCK_D)
        x1 = tl.load(x1_ptrs, mask=mask, other=0.0)
        x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(x1_ptrs, (x1f * c - x2f * s).to(x1.dtype), mask=mask)
        tl.store(x1_ptrs + HALF, (x2f * c + x1f * s).to(x1.dtype), mask=mask)


def _rotate_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    num_tokens, n_heads, head_dim = x.shape
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(n_heads), max(1, 4096 // block_d))  # cap the tile at 4096 elements
    grid = (num_tokens, triton.cdiv(n_heads, block_h))
    _rotary_kernel[grid](
        x, cos, sin, positions, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), n_heads,
        HALF=half, BLOCK_H=block_h, BLOCK_D=block_d,
    )  # fmt: skip


def apply_rotary_triton(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        positions: torch.Tensor) -> None:
    """Triton version of `apply_rotary_torch` (same arguments): in place on strided query/key views."""
    if triton is None:
        raise RuntimeError("apply_rotary_triton needs triton, which is not installed")
    _check_rotary_args(query, key, cos, sin, positions)
    for x in (query, key, cos, sin):
        if x.stride(-1) != 1:
            raise ValueError(f"rotary tensors need a unit stride along the last dim, got strides {x.stride()}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or key.dtype != query.dtype:
        raise ValueError(f"triton rotary supports fp16/bf16/fp32 q/k of one dtype, got {query.dtype}, {key.dtype}")
    if query.shape[0] == 0:
        return
    _rotate_triton(query, cos, sin, positions)
    _rotate_triton(key, cos, sin, positions)

"""RMSNorm (Llama) and LayerNorm (GPT-2), each fused with the residual add that precedes it.

Both take `x` and an optional `residual` and return `(out, s)` with `s = x + residual` (or `x`): the
model keeps `s` as the new residual stream and feeds `out` to the next layer.
"""

import torch
import torch.nn.functional as F

try:  # Triton is optional: the torch path must import on machines without it.
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# One program normalises one whole row; rows longer than 64 KiB would spill (as in Triton's tutorial).
_MAX_FUSED_BYTES = 65536


def _residual_sum(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return x if residual is None else x + residual


def rms_norm_torch(
    x: torch.Tensor,  # (T, H)
    weight: torch.Tensor,  # (H,)
    eps: float,
    residual: torch.Tensor | None = None,  # (T, H)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference and CPU path; mirrors HF `LlamaRMSNorm` op for op (float32 math even for float64)."""
    s = _residual_sum(x, residual)  # (T, H)
    h = s.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype), s


def layer_norm_torch(
    x: torch.Tensor,  # (T, H)
    weight: torch.Tensor,  # (H,)
    bias: torch.Tensor,  # (H,)
    eps: float,
    residual: torch.Tensor | None = None,  # (T, H)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference and CPU path; what `nn.LayerNorm` computes, in s's dtype."""
    s = _residual_sum(x, residual)  # (T, H)
    return F.layer_norm(s, (s.shape[-1],), weight, bias, eps), s


if triton is not None:

    @triton.jit
    def _add_rounded(a, b):
        # Add in fp32 and round once, as torch does for 16-bit types; the interpreter would add bf16 as uint16.
        return (a.to(tl.float32) + b.to(tl.float32)).to(a.dtype)

    @triton.jit
    def _norm_kernel(
        x_ptr,  # (T, H) input rows
        residual_ptr,  # (T, H) residual rows, read only if HAS_RESIDUAL
        sum_ptr,  # (T, H) output x + residual, written only if HAS_RESIDUAL
        out_ptr,  # (T, H) normalised output
        weight_ptr,  # (H,) scale
        bias_ptr,  # (H,) shift, read only if LAYER_NORM
        stride_x,  # row stride of x
        stride_r,  # row stride of residual
        stride_s,  # row stride of sum
        stride_o,  # row stride of out
        H,  # row length
        eps,  # added to the mean square (RMSNorm) or the variance (LayerNorm)
        LAYER_NORM: tl.constexpr,  # LayerNorm (centred, with bias) instead of RMSNorm
        HAS_RESIDUAL: tl.constexpr,  # fuse the residual add
        BLOCK_H: tl.constexpr,  # H rounded up to a power of two
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            s = _add_rounded(s, tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0))
            tl.store(sum_ptr + row * stride_s + cols, s, mask=mask)
        h = s.to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=mask).to(tl.float32)
        if LAYER_NORM:
            mean = tl.sum(h, axis=0) / H
            centred = tl.where(mask, h - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / H + eps)
            b = tl.load(bias_ptr + cols, mask=mask).to(tl.float32)
            out = centred * rstd * w + b
        else:
            rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
            # Round to s's dtype before the weight multiply, as HF does.
            out = w * (h * rstd).to(s.dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_norm_args(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be (T, H) with unit column stride, got shape {tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"triton norms support fp16/bf16/fp32, got {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} {tuple(x.shape)}")
    for p in (weight,) if bias is None else (weight, bias):
        if p.shape != (x.shape[1],) or not p.is_contiguous():
            raise ValueError(f"norm parameters must be contiguous ({x.shape[1]},), got {tuple(p.shape)}")
    if x.shape[1] * x.element_size() > _MAX_FUSED_BYTES:
        raise ValueError(f"hidden size {x.shape[1]} is too large for a one-block-per-row norm")


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `rms_norm_torch` (same arguments and result): one program per row."""
    return _norm_triton(x, weight, None, eps, residual)


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `layer_norm_torch` (same arguments and result): one program per row,
    statistics in float32."""
    return _norm_triton(x, weight, bias, eps, residual)


def _norm_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm where there is a bias, RMSNorm where there is none."""
    if triton is None:
        raise RuntimeError(f"{'rms' if bias is None else 'layer'}_norm_triton needs triton, which is not installed")
    _check_norm_args(x, residual, weight, bias)
    # Output dtype follows torch promotion of `weight * normed`, as in the references.
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    s = x if residual is None else torch.empty_like(x)
    r = x if residual is None else residual  # a dummy pointer when there is no residual
    b = weight if bias is None else bias  # likewise
    if x.shape[0] > 0:
        block_h = triton.next_power_of_2(x.shape[1])
        _norm_kernel[(x.shape[0],)](
            x, r, s, out, weight, b, x.stride(0), r.stride(0), s.stride(0), out.stride(0), x.shape[1], eps,
            LAYER_NORM=bias is not None, HAS_RESIDUAL=residual is not None,
            BLOCK_H=block_h, num_warps=min(max(block_h // 256, 1), 8),
        )  # fmt: skip
    return out, s

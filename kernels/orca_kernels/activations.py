"""MLP activations: SwiGLU's `silu(gate) * up` (Llama) and the tanh GELU (GPT-2's `gelu_new`)."""

import math

import torch
import torch.nn.functional as F

try:  # Triton is optional: the torch path must import on machines without it.
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_BLOCK = 1024  # elements per program for both element-wise kernels
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
    """Reference and CPU path: the gate is the first half of the fused gate/up projection."""
    gate, up = x.chunk(2, dim=-1)  # (T, I) each
    return F.silu(gate) * up


def gelu_tanh_torch(x: torch.Tensor) -> torch.Tensor:
    """Reference and CPU path: HF `NewGELUActivation`, written the same way so float64 matches exactly."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh_cpu(x: torch.Tensor) -> torch.Tensor:
    """CPU path: torch's fused tanh GELU (the same formula), one pass and no thread hand-off. The
    composite above runs five element-wise ops, and OpenMP wakes its threads for `tanh` even at one
    row: 80 us there against 3 fused (2 threads, passive waits). float64 keeps the composite, so
    the exactness tests compare against transformers bit for bit as before."""
    if x.dtype == torch.float64:
        return gelu_tanh_torch(x)
    return F.gelu(x, approximate="tanh")


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr,  # (T, 2I) gate in the first I columns, up in the last I
        out_ptr,  # (T, I) contiguous output
        stride_x,  # row stride of x
        I,  # intermediate size
        BLOCK: tl.constexpr,  # columns per program
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0)
        # Round silu to the input dtype before the multiply, as the two eager torch ops do.
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        tl.store(out_ptr + row * I + cols, (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=mask)

    @triton.jit
    def _gelu_tanh_kernel(
        x_ptr,  # (N,) contiguous input
        out_ptr,  # (N,) contiguous output
        N,  # number of elements
        BLOCK: tl.constexpr,  # elements per program
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        u = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)  # sqrt(2/pi) * (x + 0.044715 x^3)
        # tanh from exp(-2|u|) <= 1: cannot overflow, and needs no libdevice.
        e = tl.exp(-2.0 * tl.abs(u))
        tanh_abs = (1.0 - e) / (1.0 + e)
        tanh_u = tl.where(u < 0, -tanh_abs, tanh_abs)
        tl.store(out_ptr + offs, (0.5 * xf * (1.0 + tanh_u)).to(x.dtype), mask=mask)


def _check_float(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"triton activations support fp16/bf16/fp32, got {x.dtype}")


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
    """Triton version of `silu_and_mul_torch`."""
    if triton is None:
        raise RuntimeError("silu_and_mul_triton needs triton, which is not installed")
    _check_float(x)
    if x.dim() != 2 or x.shape[1] % 2 != 0 or x.stride(1) != 1:
        raise ValueError(f"x must be (T, 2I) with unit column stride, got {tuple(x.shape)} strides {x.stride()}")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, _BLOCK))](x, out, x.stride(0), inter, BLOCK=_BLOCK)
    return out


def gelu_tanh_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of `gelu_tanh_torch`, any shape."""
    if triton is None:
        raise RuntimeError("gelu_tanh_triton needs triton, which is not installed")
    _check_float(x)
    x_flat = x.contiguous().view(-1)
    out = torch.empty_like(x_flat)
    if x_flat.numel() > 0:
        _gelu_tanh_kernel[(triton.cdiv(x_flat.numel(), _BLOCK),)](x_flat, out, x_flat.numel(), BLOCK=_BLOCK)
    return out.view(x.shape)

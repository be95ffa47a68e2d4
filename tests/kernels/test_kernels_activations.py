"""SwiGLU's silu_and_mul and GPT-2's tanh GELU."""

import math

import pytest
import torch
import torch.nn.functional as F

from orca_kernels.activations import gelu_tanh_torch, gelu_tanh_triton, silu_and_mul_torch, silu_and_mul_triton

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _x(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return (3 * torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(dtype)


def test_silu_and_mul_torch_formula():
    x = _x((4, 2 * 24), torch.float64)
    assert torch.equal(silu_and_mul_torch(x), F.silu(x[:, :24]) * x[:, 24:])


def test_gelu_tanh_torch_formula():
    x = _x((4, 24), torch.float64)
    expected = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    assert torch.equal(gelu_tanh_torch(x), expected)


@pytest.mark.triton
@pytest.mark.parametrize("inter", [24, 1100])  # 1100 spans two column blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_and_mul_triton(inter, dtype):
    x = _x((3, 2 * inter), dtype)
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_torch(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("shape", [(3, 24), (2, 5, 700)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gelu_tanh_triton(shape, dtype):
    x = _x(shape, dtype)
    x[0, 0] = 30.0  # tanh saturation
    x[0, 1] = -30.0
    torch.testing.assert_close(gelu_tanh_triton(x), gelu_tanh_torch(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_gelu_tanh_cpu_equals_the_reference(rows):
    from orca_kernels.activations import gelu_tanh_cpu

    x = torch.randn(rows, 1024) * 4
    torch.testing.assert_close(gelu_tanh_cpu(x), gelu_tanh_torch(x), atol=1e-6, rtol=1e-5)
    x64 = x.double()
    assert torch.equal(gelu_tanh_cpu(x64), gelu_tanh_torch(x64)), "float64 keeps HF's composite exactly"

"""RMSNorm and LayerNorm with the fused residual add."""

import pytest
import torch
import torch.nn.functional as F

from orca_kernels.norms import layer_norm_torch, layer_norm_triton, rms_norm_torch, rms_norm_triton

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _assert_sum_equal(s: torch.Tensor, expected: torch.Tensor) -> None:
    if s.dtype == torch.bfloat16:
        # Triton's interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest): allow 1 ulp.
        torch.testing.assert_close(s, expected, atol=0.0, rtol=2**-7)
    else:
        assert torch.equal(s, expected)


def _inputs(hidden: int, dtype: torch.dtype, num_tokens: int = 5):
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(num_tokens, hidden, generator=gen).to(dtype) for _ in range(2))
    weight, bias = (torch.randn(hidden, generator=gen).to(dtype) for _ in range(2))
    return x, residual, weight, bias


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_torch_formula(with_residual):
    x, residual, weight, _ = _inputs(48, torch.float64)
    out, s = rms_norm_torch(x, weight, 1e-6, residual if with_residual else None)
    s_exp = x + residual if with_residual else x
    h = s_exp.float()
    assert torch.equal(s, s_exp)
    assert torch.equal(out, weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).double())


@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_torch_formula(with_residual):
    x, residual, weight, bias = _inputs(48, torch.float64)
    out, s = layer_norm_torch(x, weight, bias, 1e-5, residual if with_residual else None)
    assert torch.equal(out, F.layer_norm(s, (48,), weight, bias, 1e-5))


# Each norm's Triton version, its torch reference, and its arguments between x and residual.
NORMS = {
    "rms": (rms_norm_triton, rms_norm_torch, lambda weight, bias: (weight, 1e-6)),
    "layer": (layer_norm_triton, layer_norm_torch, lambda weight, bias: (weight, bias, 1e-5)),
}


@pytest.mark.triton
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 80, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_norm_triton(norm, with_residual, hidden, dtype):
    norm_triton, norm_torch, params = NORMS[norm]
    x, residual, weight, bias = _inputs(hidden, dtype)
    args = (x, *params(weight, bias), residual if with_residual else None)
    out, s = norm_triton(*args)
    out_exp, s_exp = norm_torch(*args)
    _assert_sum_equal(s, s_exp)
    torch.testing.assert_close(out, out_exp, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.triton
def test_rms_norm_triton_fp32_weight_promotes():
    x, _, _, _ = _inputs(64, torch.float16)
    weight = torch.rand(64)
    out, _ = rms_norm_triton(x, weight, 1e-6)
    out_exp, _ = rms_norm_torch(x, weight, 1e-6)
    assert out.dtype == out_exp.dtype == torch.float32
    torch.testing.assert_close(out, out_exp, atol=1e-5, rtol=1e-5)

"""The torch paths equal Hugging Face's own modules bit for bit in float64 (the model tests rely on it)."""

import pytest
import torch

from orca_kernels.activations import gelu_tanh_torch, silu_and_mul_torch
from orca_kernels.norms import layer_norm_torch, rms_norm_torch
from orca_kernels.rotary import apply_rotary_torch



# Imported by the tests that use them, not at collection: every pytest worker of `make test` collects
# this module, and most run none of its tests (transformers takes 1-3 s to import here).
@pytest.fixture(scope="module")
def llama():
    return pytest.importorskip("transformers.models.llama.modeling_llama")


@pytest.fixture(scope="module")
def hf_activations():
    return pytest.importorskip("transformers.activations")


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_rms_norm_matches_llama(llama):
    x, residual = _randn(5, 48), _randn(5, 48) * 0.5
    hf = llama.LlamaRMSNorm(48, eps=1e-6).double()
    with torch.no_grad():
        hf.weight.copy_(_randn(48))
        out, s = rms_norm_torch(x, hf.weight, 1e-6, residual)
        assert torch.equal(s, residual + x)
        assert torch.equal(out, hf(residual + x))


def test_layer_norm_matches_nn():
    x = _randn(5, 48)
    ln = torch.nn.LayerNorm(48, eps=1e-5).double()
    with torch.no_grad():
        ln.weight.copy_(_randn(48))
        assert torch.equal(layer_norm_torch(x, ln.weight, ln.bias, 1e-5)[0], ln(x))


def test_gelu_matches_gelu_new(hf_activations):
    x = _randn(4, 64) * 3
    assert torch.equal(gelu_tanh_torch(x), hf_activations.NewGELUActivation()(x))


def test_silu_and_mul_matches_llama_mlp(hf_activations):
    x = _randn(4, 64)
    assert torch.equal(silu_and_mul_torch(x), hf_activations.ACT2FN["silu"](x[:, :32]) * x[:, 32:])


def test_rotary_matches_apply_rotary_pos_emb(llama):
    num_tokens, nh, nkv, hd = 6, 4, 2, 16
    q, k = _randn(num_tokens, nh, hd), _randn(num_tokens, nkv, hd) + 1
    angles = torch.arange(32, dtype=torch.float64)[:, None] * torch.rand(hd // 2, dtype=torch.float64)[None, :]
    positions = torch.tensor([0, 3, 3, 7, 31, 12])
    cos_full = torch.cat((angles.cos(), angles.cos()), dim=-1)[positions][None]  # (1, T, hd), HF layout
    sin_full = torch.cat((angles.sin(), angles.sin()), dim=-1)[positions][None]
    # HF wants (B, heads, T, hd)
    q_hf, k_hf = llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_full, sin_full)
    apply_rotary_torch(q, k, angles.cos(), angles.sin(), positions)
    assert torch.equal(q, q_hf[0].transpose(0, 1)) and torch.equal(k, k_hf[0].transpose(0, 1))

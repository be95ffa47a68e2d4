"""Ragged paged attention: the fast torch path, the C CPU kernel and the Triton kernel against the dense
reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_kernels import attention_cpu
from orca_kernels.attention import (
    attention_dense_reference,
    ragged_attention_torch,
    ragged_attention_triton,
)

# The CPU implementations share one contract and one set of tests: the torch path and the C kernel.
CPU_IMPLS = [pytest.param(ragged_attention_torch, id="torch"),
             pytest.param(attention_cpu.ragged_attention_cpu, id="c", marks=pytest.mark.skipif(
                 not attention_cpu.available(torch.float32), reason="no C compiler here"))]


# (q_len, seq_len): a 1-token prompt, a whole prompt, a chunk after cached context, decodes (one past a
# 64-position KV tile), and a chunk longer than a 16-token query block.
MIXED = [(1, 1), (7, 7), (5, 23), (1, 70), (18, 75), (1, 17)]
DECODES = [(1, 1), (1, 9), (1, 33), (1, 70)]
HEADS = [(4, 4), (4, 2), (8, 2), (4, 1), (6, 2)]  # GQA ratios 1, 2, 4, MQA, and a non-power-of-two group 3
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


# ---- torch path ------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive", "scattered"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_cpu_paths_match_dense(attention_batch, impl, dtype, block_size, scattered, num_heads, num_kv_heads):
    batch = attention_batch(MIXED, num_heads, num_kv_heads, 64, block_size, dtype, scattered)
    _assert_close(impl(*batch.args()), attention_dense_reference(*batch.args()))


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("head_dim", [8, 80, 96, 128, 256])
@pytest.mark.parametrize(
    "requests", [MIXED, DECODES, [(12, 12)], [(3, 40)], [(40, 40)]], ids=["mixed", "decodes", "prompt", "chunk", "long"]
)
def test_cpu_paths_shapes(attention_batch, impl, head_dim, requests):
    batch = attention_batch(requests, 4, 2, head_dim, 16, torch.float64, scattered=True)
    _assert_close(impl(*batch.args()), attention_dense_reference(*batch.args()))


def test_torch_reduced_precision(attention_batch):
    batch = attention_batch(MIXED, 8, 2, 64, 16, torch.bfloat16, scattered=True)
    expected = attention_dense_reference(*batch.args())  # fp32 softmax, rounded once
    _assert_close(ragged_attention_torch(*batch.args()), expected)


def test_dense_reference_is_causal(attention_batch):
    """Changing a token's own future (later positions of its request) must not change its output."""
    batch = attention_batch([(4, 10)], 2, 2, 16, 4, torch.float64, scattered=False)
    before = attention_dense_reference(*batch.args())
    last_block = batch.block_tables[0, 2]  # positions 8, 9: the last two query tokens
    batch.k_cache[last_block, 0:2] += 1.0
    after = attention_dense_reference(*batch.args())
    assert torch.equal(before[:2], after[:2]) and not torch.equal(before[2:], after[2:])


@settings(max_examples=25, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 12), st.integers(0, 30)).map(lambda t: (t[0], t[0] + t[1])), min_size=1, max_size=5
    ),
    heads=st.sampled_from(HEADS),
    head_dim=st.sampled_from([8, 16, 24]),
    block_size=st.sampled_from([1, 2, 4, 16]),
    scattered=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_cpu_paths_property(attention_batch, requests, heads, head_dim, block_size, scattered, seed):
    batch = attention_batch(requests, *heads, head_dim, block_size, torch.float64, scattered, seed)
    expected = attention_dense_reference(*batch.args())
    _assert_close(ragged_attention_torch(*batch.args()), expected)
    if attention_cpu.available(torch.float64):
        _assert_close(attention_cpu.ragged_attention_cpu(*batch.args()), expected)


# ---- Triton kernel (interpreter on CPU) ------------------------------------------------------------


@pytest.mark.triton
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_triton_heads_and_dims(attention_batch, num_heads, num_kv_heads, head_dim):
    batch = attention_batch(MIXED, num_heads, num_kv_heads, head_dim, 16, torch.float32, scattered=True)
    _assert_close(ragged_attention_triton(*batch.args()), attention_dense_reference(*batch.args()))


@pytest.mark.triton
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("requests", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_triton_layouts(attention_batch, block_size, scattered, requests):
    batch = attention_batch(requests, 4, 2, 64, block_size, torch.float32, scattered)
    _assert_close(ragged_attention_triton(*batch.args()), attention_dense_reference(*batch.args()))


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 1)])
def test_triton_half_precision(attention_batch, dtype, num_heads, num_kv_heads):
    batch = attention_batch(MIXED, num_heads, num_kv_heads, 80, 16, dtype, scattered=True)
    _assert_close(ragged_attention_triton(*batch.args()), attention_dense_reference(*batch.args()))


@pytest.mark.triton
def test_triton_head_dim_256(attention_batch):
    batch = attention_batch([(1, 20), (6, 30), (3, 3)], 2, 1, 256, 16, torch.float32, scattered=True)
    _assert_close(ragged_attention_triton(*batch.args()), attention_dense_reference(*batch.args()))


@pytest.mark.triton
@pytest.mark.parametrize("max_query_len", [None, 18, 1000])
def test_triton_tile_hint_does_not_change_result(attention_batch, max_query_len):
    batch = attention_batch(MIXED, 4, 2, 64, 16, torch.float32, scattered=True)
    out = ragged_attention_triton(*batch.args(), max_query_len=max_query_len)
    _assert_close(out, attention_dense_reference(*batch.args()))


@pytest.mark.triton
def test_triton_strided_query(attention_batch):
    """The runner passes query as a view into a fused qkv projection."""
    batch = attention_batch(MIXED, 4, 2, 64, 16, torch.float32, scattered=True)
    qkv = torch.randn(batch.query.shape[0], 4 + 2 * 2, 64)  # (T, nh + 2 nkv, hd)
    qkv[:, :4] = batch.query
    batch.query = qkv[:, :4]
    assert not batch.query.is_contiguous()
    _assert_close(ragged_attention_triton(*batch.args()), attention_dense_reference(*batch.args()))


@pytest.mark.triton
def test_triton_empty_batch(attention_batch):
    batch = attention_batch([(1, 1)], 2, 1, 16, 4, torch.float32, scattered=False)
    batch.query, batch.query_start_loc = batch.query[:0], torch.zeros(2, dtype=torch.int32)
    batch.seq_lens = torch.zeros(1, dtype=torch.int32)
    assert ragged_attention_triton(*batch.args()).shape == (0, 2, 16)


def test_rejects_bad_index_dtype(attention_batch):
    batch = attention_batch(DECODES, 2, 1, 16, 4, torch.float32, scattered=False)
    batch.seq_lens = batch.seq_lens.long()
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        ragged_attention_torch(*batch.args())

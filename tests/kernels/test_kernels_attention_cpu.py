"""The compiled CPU attention kernel (kernels/csrc/ragged_attention.c) against the dense reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import attention_cpu
from kernels.attention import attention_dense_reference
from kernels.attention_cpu import ragged_attention_cpu
from tests.kernels.test_kernels_attention import DECODES, HEADS, MIXED, _assert_close

pytestmark = pytest.mark.skipif(not attention_cpu.available(torch.float32), reason="no C compiler here")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive", "scattered"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_matches_dense(attention_batch, dtype, block_size, scattered, num_heads, num_kv_heads):
    batch = attention_batch(MIXED, num_heads, num_kv_heads, 64, block_size, dtype, scattered)
    _assert_close(ragged_attention_cpu(*batch.args()), attention_dense_reference(*batch.args()))


@pytest.mark.parametrize("head_dim", [8, 80, 96, 128, 256])
@pytest.mark.parametrize(
    "requests", [MIXED, DECODES, [(12, 12)], [(3, 40)], [(40, 40)]], ids=["mixed", "decodes", "prompt", "chunk", "long"]
)
def test_shapes(attention_batch, head_dim, requests):
    batch = attention_batch(requests, 4, 2, head_dim, 16, torch.float64, scattered=True)
    _assert_close(ragged_attention_cpu(*batch.args()), attention_dense_reference(*batch.args()))


def test_strided_query_from_a_fused_projection(attention_batch):
    """The model passes q as a view of its fused qkv output: token stride > heads * head_dim."""
    batch = attention_batch(MIXED, 8, 2, 64, 16, torch.float32, scattered=True)
    fused = torch.randn(batch.query.shape[0], 8 * 64 + 2 * 2 * 64)
    fused[:, :8 * 64] = batch.query.reshape(batch.query.shape[0], -1)
    query = fused[:, :8 * 64].view(-1, 8, 64)
    args = (query, *batch.args()[1:])
    _assert_close(ragged_attention_cpu(*args), attention_dense_reference(*batch.args()))


def test_max_seq_len_hint_gives_the_same_result(attention_batch):
    batch = attention_batch(MIXED, 4, 2, 64, 16, torch.float32, scattered=True)
    exact = ragged_attention_cpu(*batch.args())
    hinted = ragged_attention_cpu(*batch.args(), max_seq_len=int(batch.seq_lens.max()), max_query_len=18)
    assert torch.equal(exact, hinted)


def test_empty_batch(attention_batch):
    batch = attention_batch([(1, 1)], 4, 2, 16, 4, torch.float32, scattered=False)
    empty = (batch.query[:0], batch.k_cache, batch.v_cache, batch.block_tables[:0], batch.seq_lens[:0],
             batch.query_start_loc[:1], batch.scale)
    assert ragged_attention_cpu(*empty).shape == (0, 4, 16)


def test_rejects_what_it_cannot_run(attention_batch):
    batch = attention_batch(MIXED, 4, 2, 16, 4, torch.bfloat16, scattered=False)
    with pytest.raises(ValueError, match="not available for torch.bfloat16"):
        ragged_attention_cpu(*batch.args())
    batch = attention_batch(MIXED, 4, 2, 16, 4, torch.float32, scattered=False)
    with pytest.raises(ValueError, match="int32"):
        ragged_attention_cpu(batch.query, batch.k_cache, batch.v_cache, batch.block_tables.long(), batch.seq_lens,
                             batch.query_start_loc, batch.scale)


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 20), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1])), min_size=1, max_size=6
    ),
    heads=st.sampled_from(HEADS),
    head_dim=st.sampled_from([8, 16, 24, 64]),
    block_size=st.sampled_from([1, 2, 4, 16]),
    scattered=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property(attention_batch, requests, heads, head_dim, block_size, scattered, seed):
    batch = attention_batch(requests, *heads, head_dim, block_size, torch.float64, scattered, seed)
    _assert_close(ragged_attention_cpu(*batch.args()), attention_dense_reference(*batch.args()))

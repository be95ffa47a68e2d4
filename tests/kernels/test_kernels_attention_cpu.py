"""What is particular to the C CPU attention kernel (kernels/orca_kernels/csrc/ragged_attention.c); its agreement
with the dense reference is tested beside the torch path's in test_kernels_attention.py."""

import pytest
import torch

from orca_kernels import attention_cpu
from orca_kernels.attention import attention_dense_reference
from orca_kernels.attention_cpu import ragged_attention_cpu
from tests.kernels.test_kernels_attention import MIXED, _assert_close

pytestmark = pytest.mark.skipif(not attention_cpu.available(torch.float32), reason="no C compiler here")


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

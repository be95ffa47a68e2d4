"""The compiled token-bitmask kernel (kernels/orca_kernels/csrc/token_bitmask.c) against its torch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_kernels import cpu_build
from orca_kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_torch

pytestmark = pytest.mark.skipif(cpu_build.load("token_bitmask") is None, reason="no C compiler here")


def bitmask_of(words: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words], dtype=torch.int32)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 200), st.integers(1, 6), st.data(), st.sampled_from([torch.float32, torch.float64]))
def test_the_kernel_masks_what_the_reference_masks(vocab, num_rows, data, dtype):
    words = -(-vocab // 32)
    word = st.one_of(st.just(0), st.just(0xFFFFFFFF), st.integers(0, 0xFFFFFFFF))  # the kernel's three paths
    masked = data.draw(st.lists(st.integers(0, num_rows - 1), min_size=1, max_size=num_rows, unique=True))
    bitmask = bitmask_of([[data.draw(word) for _ in range(words)] for _ in masked])
    logits = torch.randn(num_rows, vocab, dtype=dtype)
    expected = logits.clone()
    apply_token_bitmask_torch(expected, masked, bitmask)
    apply_token_bitmask(logits, masked, bitmask)
    assert torch.equal(logits, expected)


def test_rows_of_a_wider_tensor_and_other_dtypes():
    bitmask = bitmask_of([[0b101, 0xFFFFFFFF]])
    wide = torch.zeros(3, 64)
    apply_token_bitmask(wide[:, :40], [1], bitmask)  # a row stride of 64, 40 tokens
    assert torch.isfinite(wide[1, :40]).nonzero().flatten().tolist() == [0, 2] + list(range(32, 40))
    assert torch.isfinite(wide[1, 40:]).all() and torch.isfinite(wide[[0, 2]]).all()
    half = torch.zeros(1, 40, dtype=torch.bfloat16)  # no kernel for it: the torch path
    apply_token_bitmask(half, [0], bitmask)
    assert torch.isfinite(half[0]).nonzero().flatten().tolist() == [0, 2] + list(range(32, 40))

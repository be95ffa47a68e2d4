"""KV accounting: never leaks, never double-allocates, prefers consecutive runs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from core.kv_cache import KVCacheManager


def test_allocate_grows_and_free_returns_exactly_what_was_held():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.allocate("a", 5) == [0, 1]
    assert kv.allocate("a", 8) == []  # still fits in two blocks
    assert kv.allocate("a", 9) == [2]  # grows in place
    assert kv.allocate("b", 100) is None and kv.num_used_blocks == 3  # refused whole, nothing taken
    assert kv.free("a") == 3 and kv.num_used_blocks == 0
    assert kv.free("a") == 0


def test_scattered_allocation_when_no_run_is_free():
    kv = KVCacheManager(num_blocks=6, block_size=1)
    for name in "abcdef":
        kv.allocate(name, 1)
    kv.free("b")
    kv.free("d")
    kv.free("f")
    assert kv.allocate("g", 3) == [1, 3, 5]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(0, 40), st.booleans()), max_size=60),
       st.integers(1, 30), st.sampled_from([1, 2, 4, 16]))
def test_ledger_balances_under_any_sequence(ops, num_blocks, block_size):
    kv = KVCacheManager(num_blocks, block_size)
    for name, tokens, free in ops:
        if free:
            kv.free(name)
        else:
            before = kv.num_free_blocks
            new = kv.allocate(name, tokens)
            if new is None:
                assert kv.num_free_blocks == before
        held = [b for n in kv.holders() for b in kv.block_ids(n)]
        assert len(held) == len(set(held)), "a block is held twice"
        assert len(held) == kv.num_used_blocks <= num_blocks
        assert all(0 <= b < num_blocks for b in held)
    for name in kv.holders():
        kv.free(name)
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == num_blocks

"""Shared set-up for the kernel tests.

Triton kernels run on CPU tensors through Triton's interpreter, which is chosen when the @triton.jit
decorators run, so TRITON_INTERPRET must be set before any kernels module is imported.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

PAD_BLOCK_ID = 1_000_000  # block table padding: an id far out of range, so reading it would fail loudly


@dataclass
class AttentionBatch:
    """Arguments of one ragged attention call, in the order the kernels take them."""

    query: torch.Tensor  # (T, nh, hd)
    k_cache: torch.Tensor  # (num_blocks, block_size, nkv, hd)
    v_cache: torch.Tensor  # (num_blocks, block_size, nkv, hd)
    block_tables: torch.Tensor  # (B, max_blocks) int32
    seq_lens: torch.Tensor  # (B,) int32
    query_start_loc: torch.Tensor  # (B + 1,) int32
    scale: float

    def args(self) -> tuple:
        return (
            self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc, self.scale
        )  # fmt: skip


def make_attention_batch(
    requests: list[tuple[int, int]],  # (q_len, seq_len) per request
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    scattered: bool,
    seed: int = 0,
) -> AttentionBatch:
    """Random batch whose unused cache slots hold NaN, so any read outside a request's context shows up."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-ctx // block_size) for _, ctx in requests]
    num_blocks = sum(blocks_needed) + 3  # a few blocks nobody owns
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(num_blocks, generator=gen) if scattered else torch.arange(1, num_blocks + 1) % num_blocks
    block_tables = torch.full((len(requests), max(blocks_needed) + 2), PAD_BLOCK_ID, dtype=torch.int32)
    k_slots, v_slots = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    used = 0
    for i, ((_, ctx), n) in enumerate(zip(requests, blocks_needed)):
        block_tables[i, :n] = order[used : used + n]
        used += n
        pos = torch.arange(ctx)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k_slots[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_slots[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
    q_lens = [q for q, _ in requests]
    query_start_loc = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor([ctx for _, ctx in requests], dtype=torch.int32)
    return AttentionBatch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, head_dim**-0.5)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "triton: runs a Triton kernel on CPU tensors through the interpreter")


def _triton_skip_reason() -> str | None:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return "triton is not installed"
    from orca_kernels import attention

    if not isinstance(attention._ragged_attention_kernel, InterpretedFunction):
        return "kernels/ was imported before TRITON_INTERPRET=1 was set (collect tests/kernels first, or alone)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("triton")]
    reason = _triton_skip_reason() if marked else None
    for item in marked if reason else []:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def attention_batch():
    """The batch factory, as a fixture because test modules cannot import conftest."""
    return make_attention_batch

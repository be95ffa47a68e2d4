"""Attention metadata of one iteration, built by the runner and passed explicitly to the model
(never a module-global context)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # (B, max_blocks) int32: each request's KV blocks, in order
    seq_lens: torch.Tensor  # (B,) int32: context length per request, this iteration's tokens included
    query_start_loc: torch.Tensor  # (B+1,) int32: where each request's tokens start in the batch
    max_query_len: int
    max_seq_len: int

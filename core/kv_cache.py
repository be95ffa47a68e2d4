"""KV-cache accounting in blocks: who holds which block. Pure bookkeeping, no tensors.

The model runner owns the tensors; this class decides which block ids a request may
write. Every policy allocates through `allocate` and releases through `free`, so the
ledger (`num_used_blocks`) is exact: after all requests end it is zero.

Blocks of a request are taken as one consecutive run when one is free: the CPU attention
path then reads a request's KV as a view instead of a gather. Correctness never depends
on it; a scattered allocation is used when no run is free.
"""

from __future__ import annotations

_FREE = b"\x01"
_USED = b"\x00"


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_map = bytearray(_FREE * num_blocks)
        self._num_free = num_blocks
        self._blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def holders(self) -> list[str]:
        return list(self._blocks)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request still lacks to hold `num_tokens` slots in all."""
        return max(0, self.blocks_needed(num_tokens) - len(self.block_ids(request_id)))

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks(request_id, num_tokens) <= self._num_free

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's blocks to hold `num_tokens` slots; return the new block ids
        (possibly empty), or None, changing nothing, when there are not enough free blocks."""
        need = self.num_new_blocks(request_id, num_tokens)
        if need > self._num_free:
            return None
        if need == 0:
            return []
        held = self._blocks.setdefault(request_id, [])
        new = self._take(need, after=held[-1] + 1 if held else None)
        held.extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Release every block the request holds; return how many. Freeing twice frees nothing."""
        blocks = self._blocks.pop(request_id, [])
        for block in blocks:
            assert self._free_map[block] == _USED[0], f"block {block} freed twice"
            self._free_map[block] = _FREE[0]
        self._num_free += len(blocks)
        return len(blocks)

    def _take(self, count: int, after: int | None) -> list[int]:
        run = count * _FREE
        if after is not None and self._free_map[after:after + count] == run:
            start = after  # extend the request's own run in place
        else:
            start = self._free_map.find(run)
        if start >= 0:
            blocks = list(range(start, start + count))
        else:
            blocks = self._scattered(count)
        for block in blocks:
            self._free_map[block] = _USED[0]
        self._num_free -= count
        return blocks

    def _scattered(self, count: int) -> list[int]:
        blocks: list[int] = []
        position = self._free_map.find(_FREE)
        while len(blocks) < count:
            blocks.append(position)
            position = self._free_map.find(_FREE, position + 1)
        return blocks

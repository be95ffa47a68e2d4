"""KV-cache accounting in blocks: who holds which block. Pure bookkeeping, no tensors.

The model runner owns the tensors; this class decides which block ids a request may write.
Every policy allocates through `allocate` and releases through `free`, so the ledger is
exact: after all requests end, no block is in use.

Blocks of a request are taken as one consecutive run when one is free: the CPU attention
path then reads a request's KV as a view instead of a gather. Correctness never depends
on it; a scattered allocation is used when no run is free.

Prefix reuse (optional): a full block is identified by the hash of its tokens chained to the
hash of the blocks before it. Requests with the same prefix share those blocks (reference
counts); a block nobody references keeps its KV and stays findable until its space is
needed, and then the least recently used such block is evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

_FREE = 1
_USED = 0

BlockKey = tuple[int | str | None, tuple[int, ...]]
"""(hash of the previous block's key, or for a first block its request's cache salt or None; its tokens)."""


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free_map = bytearray([_FREE]) * num_blocks  # free and not holding cached KV
        self._num_free = num_blocks
        self._blocks: dict[str, list[int]] = {}
        self._refs = [0] * num_blocks
        self._key_of: dict[int, BlockKey] = {}  # cached full blocks (referenced or evictable)
        self._block_of: dict[BlockKey, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refs == 0 but KV kept, LRU first
        self._registered: dict[str, tuple[int, int | str | None]] = {}  # per request: blocks registered, chain
        self.prefix_hits = 0

    # ---- figures -----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (truly free, or cached but unreferenced)."""
        return self._num_free + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

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
        return self.num_new_blocks(request_id, num_tokens) <= self.num_free_blocks

    # ---- verbs -------------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's blocks to hold `num_tokens` slots in all; return the new block ids
        (possibly empty), or None, changing nothing, when there are not enough free blocks."""
        need = self.num_new_blocks(request_id, num_tokens)
        if need > self.num_free_blocks:
            return None
        if need == 0:
            self._blocks.setdefault(request_id, [])
            return []
        held = self._blocks.setdefault(request_id, [])
        if need > self._num_free:
            self._evict(need - self._num_free)
        new = self._take(need, after=held[-1] + 1 if held else None)
        for block in new:
            self._refs[block] = 1
        held.extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Release every block the request holds; return how many. Freeing twice frees nothing."""
        blocks = self._blocks.pop(request_id, [])
        self._registered.pop(request_id, None)
        for block in reversed(blocks):  # the tail is the least likely to be reused: evict it first
            assert self._refs[block] > 0, f"block {block} freed twice"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free_map[block] = _FREE
                    self._num_free += 1
        return len(blocks)

    # ---- prefix reuse ------------------------------------------------------------------

    def share_cached_prefix(self, request_id: str, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Give a request that holds nothing yet the cached blocks of its longest known prefix;
        return how many tokens they cover. At least one token is always left to compute, so
        the request still produces logits for its next token. `salt` (vLLM's cache_salt): only blocks
        registered with the same salt are found (its first block's key holds it, and every later key
        chains from that one)."""
        if not self.enable_prefix_caching or self._blocks.get(request_id):
            return 0
        usable = (len(token_ids) - 1) // self.block_size
        shared: list[int] = []
        parent: int | str | None = salt
        for i in range(usable):
            key = (parent, tuple(token_ids[i * self.block_size:(i + 1) * self.block_size]))
            block = self._block_of.get(key)
            if block is None:
                break
            shared.append(block)
            parent = hash(key)
        for block in shared:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        if shared:
            self._blocks[request_id] = shared
            self._registered[request_id] = (len(shared), parent)
            self.prefix_hits += len(shared)
        return len(shared) * self.block_size

    def register_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                             salt: str | None = None) -> None:
        """Make the request's blocks that are full of computed tokens findable by later requests (with the
        same `salt`)."""
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks.get(request_id, [])
        done, parent = self._registered.get(request_id, (0, salt))
        full = min(num_computed // self.block_size, len(blocks))
        for i in range(done, full):
            key = (parent, tuple(token_ids[i * self.block_size:(i + 1) * self.block_size]))
            if key not in self._block_of and blocks[i] not in self._key_of:
                self._block_of[key] = blocks[i]
                self._key_of[blocks[i]] = key
            parent = hash(key)
        if full > done:
            self._registered[request_id] = (full, parent)

    def check(self) -> None:
        """Assert the ledger is consistent (tests call it after every step)."""
        holders: dict[int, int] = {}
        for blocks in self._blocks.values():
            assert len(blocks) == len(set(blocks)), "a request holds a block twice"
            for block in blocks:
                holders[block] = holders.get(block, 0) + 1
        for block in range(self.num_blocks):
            refs, free, cached = self._refs[block], self._free_map[block] == _FREE, block in self._evictable
            assert refs == holders.get(block, 0), f"block {block}: {refs} refs, {holders.get(block, 0)} holders"
            assert (refs > 0) + free + cached == 1, f"block {block} is in more or less than one state"
        assert self._num_free == sum(1 for b in self._free_map if b == _FREE)

    # ---- internals ---------------------------------------------------------------------

    def _evict(self, count: int) -> None:
        for _ in range(count):
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self._free_map[block] = _FREE
            self._num_free += 1

    def _take(self, count: int, after: int | None) -> list[int]:
        run = bytes([_FREE]) * count
        if after is not None and self._free_map[after:after + count] == run:
            start = after  # extend the request's own run in place
        else:
            start = self._free_map.find(run)
        blocks = list(range(start, start + count)) if start >= 0 else self._scattered(count)
        for block in blocks:
            self._free_map[block] = _USED
        self._num_free -= count
        return blocks

    def _scattered(self, count: int) -> list[int]:
        blocks: list[int] = []
        position = self._free_map.find(_FREE)
        while len(blocks) < count:
            blocks.append(position)
            position = self._free_map.find(_FREE, position + 1)
        return blocks

"""KVCacheManager: block tables per request on top of the :class:`BlockPool`.

Blocks are allocated only as tokens arrive (a request holding ``t`` tokens of
KV owns ``ceil(t / block_size)`` blocks) and freed on finish, abort and
preemption. The scheduler sees block ids, never the pool. Pure Python.
"""

from __future__ import annotations

from llmserve.kv_cache.block_pool import BlockPool, KVCacheBlock
from llmserve.utils import cdiv


class KVCacheManager:
    """Per-request block tables.

    Args:
        num_blocks: blocks in the pool (block 0 is the reserved null block).
        block_size: token slots per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        """KV cache usage in [0, 1] (vLLM's ``kv_cache_usage_perc`` / 100)."""
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Make sure ``request_id`` owns enough blocks for ``num_total_tokens`` tokens.

        Args:
            num_total_tokens: ``num_computed_tokens + num_new_tokens`` after the step.

        Returns:
            True on success; False if the pool has too few free blocks, in
            which case nothing is allocated.
        """
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = self.num_blocks_needed(num_total_tokens) - len(blocks)
        if num_new <= 0:
            return True
        if num_new > self.block_pool.get_num_free_blocks():
            if not blocks:
                del self.req_to_blocks[request_id]
            return False
        blocks.extend(self.block_pool.get_new_blocks(num_new))
        return True

    def free(self, request_id: str) -> None:
        """Return every block of ``request_id`` to the pool (no-op if it has none).

        The tail blocks are freed first so they are evicted first once cached
        blocks are kept for prefix caching.
        """
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of ``request_id`` (a fresh list of block ids)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

"""KVCacheManager: block tables per request on top of the :class:`BlockPool`.

Blocks are allocated only as tokens arrive (a request holding ``t`` tokens of
KV owns ``ceil(t / block_size)`` blocks) and freed on finish, abort and
preemption. The scheduler sees block ids, never the pool. Pure Python.

Sharing: a block may sit in several block tables (a prefix-cache hit, or
sequences forked from one prompt for ``n > 1``). A shared or cached block is
never written: before a request writes into one, it gets a private copy
(copy-on-write); the scheduler passes the ``(src, dst)`` pairs to the runner,
which copies the KV before the forward pass::

    A: [3, 8, 5]          fork        A: [3, 8, 5]     B writes token 40 into block 5:
                        ------->      B: [3, 8, 5]     B: [3, 8, 9]  + copy 5 -> 9
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.kv_cache.block_pool import BlockPool, KVCacheBlock
from llmserve.kv_cache.prefix_cache import extend_block_hashes
from llmserve.utils import cdiv


@dataclass
class PrefixCacheStats:
    """Token counts, as vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``."""

    queries: int = 0
    hits: int = 0
    requests: int = 0


class KVCacheManager:
    """Per-request block tables, prefix caching and copy-on-write.

    Args:
        num_blocks: blocks in the pool (block 0 is the reserved null block).
        block_size: token slots per block.
        enable_caching: automatic prefix caching.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_hashes: dict[str, list[bytes]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

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

    # ------------------------------------------------------------ prefix cache
    def _hashes(self, request_id: str, token_ids: list[int], extra_keys: bytes) -> list[bytes]:
        hashes = self.req_to_hashes.setdefault(request_id, [])
        return extend_block_hashes(hashes, token_ids, self.block_size, extra_keys)

    def get_computed_blocks(self, request_id: str, token_ids: list[int],
                            extra_keys: bytes = b"") -> list[KVCacheBlock]:
        """Longest cached prefix of full blocks, stopping one token short of the end
        (the last token is always computed so there are logits to sample).

        The blocks are not referenced yet: pass them to :meth:`allocate_slots`.
        """
        if not self.enable_caching:
            return []
        hashes = self._hashes(request_id, token_ids, extra_keys)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (tokens)."""
        if self.enable_caching:
            self.stats.requests += 1
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    def cache_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int,
                     extra_keys: bytes = b"") -> None:
        """Register the request's newly full and computed blocks in the prefix cache."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request_id, token_ids[:num_full * self.block_size], extra_keys)
        for i in range(start, num_full):
            self.block_pool.cache_full_block(blocks[i], hashes[i])
        self.num_cached_blocks[request_id] = num_full

    # ------------------------------------------------------------ allocation
    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       ) -> list[tuple[int, int]] | None:
        """Give ``request_id`` the blocks to write ``num_new_tokens`` tokens after
        its first ``num_computed_tokens`` (whose KV is already in its blocks or in
        ``new_computed_blocks``, a prefix-cache hit for a request without blocks).

        Returns:
            The copy-on-write pairs ``[(src_block, dst_block)]`` the runner must
            copy before the forward pass (usually empty), or None when the pool
            has too few free blocks, in which case nothing changes.
        """
        blocks = self.req_to_blocks.get(request_id, [])
        computed = list(new_computed_blocks or ())
        total = num_computed_tokens + num_new_tokens
        have = len(blocks) + len(computed)
        num_new = max(0, self.num_blocks_needed(total) - have)
        # blocks this step writes into that are shared or cached need a private copy
        first = num_computed_tokens // self.block_size
        last = min(self.num_blocks_needed(total), have)
        all_blocks = blocks + computed
        cow = [i for i in range(first, last)
               if all_blocks[i].ref_cnt > 1 or all_blocks[i].block_hash is not None]
        free_needed = num_new + len(cow) + sum(1 for b in computed if b.ref_cnt == 0)
        if free_needed > self.block_pool.get_num_free_blocks():
            return None
        if computed:
            self.block_pool.touch(computed)
        blocks = blocks + computed
        self.req_to_blocks[request_id] = blocks
        copies: list[tuple[int, int]] = []
        for i in cow:
            src = blocks[i]
            dst = self.block_pool.get_new_blocks(1)[0]
            copies.append((src.block_id, dst.block_id))
            blocks[i] = dst
            self.block_pool.free_blocks([src])
            self.num_cached_blocks[request_id] = min(self.num_cached_blocks.get(request_id, 0), i)
        if num_new:
            blocks.extend(self.block_pool.get_new_blocks(num_new))
        if request_id not in self.num_cached_blocks:
            self.num_cached_blocks[request_id] = len(computed)
        return copies

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Share the parent's blocks holding its first ``num_tokens`` tokens with a new
        request (reference counts up; copy-on-write happens on the next write)."""
        if child_id in self.req_to_blocks:
            raise ValueError(f"request {child_id!r} already owns blocks")
        shared = self.req_to_blocks[parent_id][:self.num_blocks_needed(num_tokens)]
        self.block_pool.touch(shared)
        self.req_to_blocks[child_id] = list(shared)
        self.num_cached_blocks[child_id] = min(self.num_cached_blocks.get(parent_id, 0),
                                               len(shared))
        if parent_id in self.req_to_hashes:
            self.req_to_hashes[child_id] = \
                self.req_to_hashes[parent_id][:num_tokens // self.block_size]

    def free(self, request_id: str) -> None:
        """Return every block of ``request_id`` to the pool (no-op if it has none).

        The tail blocks are freed first so they are evicted first (LRU: a
        request's last blocks are the least likely to be shared).
        """
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        self.req_to_hashes.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(list(reversed(blocks)))

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the tail blocks of ``request_id`` beyond the first ``ceil(num_tokens /
        block_size)`` (speculative decoding: the slots of rejected drafts roll back)."""
        blocks = self.req_to_blocks.get(request_id)
        keep = self.num_blocks_needed(num_tokens)
        if not blocks or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        self.num_cached_blocks[request_id] = min(self.num_cached_blocks.get(request_id, 0), keep)
        self.block_pool.free_blocks(list(reversed(tail)))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of ``request_id`` (a fresh list of block ids)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def prefix_cache_digest(self) -> tuple[int, list[bytes]]:
        """``(version, block hashes)`` of the prefix cache (:meth:`BlockPool.cached_block_hashes`)."""
        return self.block_pool.cached_block_hashes()

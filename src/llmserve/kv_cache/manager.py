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
        kv_store: a shared KV store (``kv_store.RedisKVStore``; needs ``enable_caching``):
            local misses are looked up there (:meth:`get_store_hits`), and newly
            cached blocks are listed for writing (:meth:`pop_newly_cached`).
        window_blocks: the window pool of a mixed model's local layers
            (``window_blocks.WindowBlocks``), or None: one pool holds every layer.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 kv_store=None, window_blocks=None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_hashes: dict[str, list[bytes]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        self.kv_store = kv_store if enable_caching else None
        # shared KV store: (block hash, block id) cached since the last pop, to be written
        self.newly_cached: list[tuple[bytes, int]] = []
        # request -> [first, end) block indices loaded from the store (not written back)
        self.store_loaded: dict[str, tuple[int, int]] = {}
        # the last lookup (request id, first block index, bodies): the queue head retries
        self._store_prefetch: tuple[str, int, list] | None = None
        # request -> tokens whose blocks were evicted or slid out of the window (whole
        # blocks, all before the first kept one's end: eviction/base.py); its block table
        # holds the kept blocks only, and its later blocks are never cached
        self.num_evicted_tokens: dict[str, int] = {}
        self.window_blocks = window_blocks

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

    def get_store_hits(self, request_id: str, token_ids: list[int], extra_keys: bytes,
                       num_local_blocks: int) -> list:
        """Bodies of the full blocks after the first ``num_local_blocks`` (the local hits)
        found in the shared KV store, stopping at the first miss and one token short of
        the end (as :meth:`get_computed_blocks`). Empty without a store."""
        if self.kv_store is None:
            return []
        pre = self._store_prefetch
        if pre is not None and pre[0] == request_id and pre[1] == num_local_blocks:
            return pre[2]
        hashes = self._hashes(request_id, token_ids, extra_keys)
        max_blocks = (len(token_ids) - 1) // self.block_size
        bodies = self.kv_store.lookup(hashes[num_local_blocks:max_blocks]) \
            if num_local_blocks < max_blocks else []
        self._store_prefetch = (request_id, num_local_blocks, bodies) if bodies else None
        return bodies

    def commit_store_hits(self, request_id: str, first: int, num: int) -> list[int]:
        """After :meth:`allocate_slots`: the block ids ``[first, first + num)`` of the
        request, to be filled from the store (they count as computed)."""
        if self._store_prefetch is not None and self._store_prefetch[0] == request_id:
            self._store_prefetch = None
        if not num:
            return []
        self.store_loaded[request_id] = (first, first + num)
        return [b.block_id for b in self.req_to_blocks[request_id][first:first + num]]

    def pop_newly_cached(self) -> list[tuple[bytes, int]]:
        """``(block hash, block id)`` of blocks computed here and cached since the last
        call (only with a store): what to write to the store now, before reuse."""
        out, self.newly_cached = self.newly_cached, []
        return out

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (tokens)."""
        if self.enable_caching:
            self.stats.requests += 1
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    def cache_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int,
                     extra_keys: bytes = b"") -> None:
        """Register the request's newly full and computed blocks in the prefix cache."""
        if not self.enable_caching or self.num_evicted_tokens.get(request_id):
            return  # after an eviction a block's KV is not its full prefix's any more
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request_id, token_ids[:num_full * self.block_size], extra_keys)
        loaded = self.store_loaded.get(request_id, (0, 0))
        for i in range(start, num_full):
            fresh = blocks[i].block_hash is None
            self.block_pool.cache_full_block(blocks[i], hashes[i])
            if self.kv_store is not None and fresh and blocks[i].block_hash is not None \
                    and not loaded[0] <= i < loaded[1]:
                self.newly_cached.append((hashes[i], blocks[i].block_id))
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
            (or the window pool) has too few free blocks, in which case nothing changes.
        """
        window = self.window_blocks
        if window is not None and not window.can_allocate(request_id, num_computed_tokens,
                                                          num_new_tokens):
            return None
        copies = self._allocate_full(request_id, num_computed_tokens, num_new_tokens,
                                     new_computed_blocks)
        if copies is not None and window is not None:
            window.allocate(request_id, num_computed_tokens, num_new_tokens)
        return copies

    def _allocate_full(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None,
                       ) -> list[tuple[int, int]] | None:
        blocks = self.req_to_blocks.get(request_id, [])
        computed = list(new_computed_blocks or ())
        num_computed_tokens -= self.num_evicted_tokens.get(request_id, 0)  # kept-block index
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
        if self.window_blocks is not None:
            raise ValueError("fork: a window pool (window_blocks.py) shares no blocks")
        evicted = self.num_evicted_tokens.get(parent_id, 0)
        shared = self.req_to_blocks[parent_id][:self.num_blocks_needed(num_tokens - evicted)]
        self.block_pool.touch(shared)
        self.req_to_blocks[child_id] = list(shared)
        if evicted:
            self.num_evicted_tokens[child_id] = evicted
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
        self.num_evicted_tokens.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        self.req_to_hashes.pop(request_id, None)
        self.store_loaded.pop(request_id, None)
        if self._store_prefetch is not None and self._store_prefetch[0] == request_id:
            self._store_prefetch = None
        if self.window_blocks is not None:
            self.window_blocks.free(request_id)
        if blocks:
            self.block_pool.free_blocks(list(reversed(blocks)))

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the tail blocks of ``request_id`` beyond the first ``ceil(num_tokens /
        block_size)`` (speculative decoding: the slots of rejected drafts roll back)."""
        blocks = self.req_to_blocks.get(request_id)
        keep = self.num_blocks_needed(num_tokens - self.num_evicted_tokens.get(request_id, 0))
        if not blocks or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        self.num_cached_blocks[request_id] = min(self.num_cached_blocks.get(request_id, 0), keep)
        self.block_pool.free_blocks(list(reversed(tail)))

    def evict_blocks(self, request_id: str, indices: list[int]) -> list[int]:
        """Drop the blocks at ``indices`` of the block table of ``request_id`` and return
        them to the pool at once (KV eviction, a sliding window). Each must be a full,
        computed block before the table's last one. From now on the request's blocks are
        not cached (their KV was computed without the evicted context); blocks cached
        before keep their hashes, whose KV is still exactly their full prefix's.

        Returns:
            The freed block ids.

        Raises:
            ValueError: for an index out of range, repeated, or the last block.
        """
        blocks = self.req_to_blocks.get(request_id, [])
        picked = sorted(set(indices))
        if len(picked) != len(indices) or any(not 0 <= i < len(blocks) - 1 for i in picked):
            raise ValueError(f"evict_blocks: bad block indices {indices} for a table of "
                             f"{len(blocks)} blocks (the last one is never evicted)")
        if not picked:
            return []
        gone = [blocks[i] for i in picked]
        for i in reversed(picked):
            del blocks[i]
        self.num_evicted_tokens[request_id] = (self.num_evicted_tokens.get(request_id, 0)
                                               + len(picked) * self.block_size)
        self.num_cached_blocks[request_id] = 0
        self.block_pool.free_blocks(gone)
        return [b.block_id for b in gone]

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of ``request_id`` (a fresh list of block ids)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_window_blocks(self, request_id: str) -> tuple[int, list[int]] | None:
        """``(first logical block, block ids)`` of the window-pool table of
        ``request_id``, or None without a window pool."""
        return None if self.window_blocks is None else self.window_blocks.get(request_id)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def prefix_cache_digest(self) -> tuple[int, list[bytes]]:
        """``(version, block hashes)`` of the prefix cache (:meth:`BlockPool.cached_block_hashes`)."""
        return self.block_pool.cached_block_hashes()

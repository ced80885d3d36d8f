"""Fixed-size KV cache blocks and the pool that hands them out (PagedAttention).

The KV cache of every layer is one array of ``num_blocks`` blocks of
``block_size`` token slots. A request owns a list of block ids, its *block
table*; token ``p`` of the request lives in slot
``block_table[p // block_size] * block_size + p % block_size``::

    block table of request A: [7, 2, 9]        block_size = 4
    tokens 0..3 -> block 7, tokens 4..7 -> block 2, tokens 8..10 -> block 9 (1 slot free)

    pool:  | 0 null | 1 free | 2 A | 3 free | ... | 7 A | 8 free | 9 A |
                      ^ free queue (doubly linked, O(1) pop/append/remove)

Block 0 is the *null block*: never handed out, used as padding in block
tables. Allocation and free are O(1) per block. Pure Python, no tensors
(the tensors live in the model runner).

Prefix caching: a full, computed block may be registered under its block
hash (see :mod:`llmserve.kv_cache.prefix_cache`). A freed block keeps its
content and hash in the free queue, where another request can hit it again
until the block is handed out anew (evicted, least recently freed first).

Source: Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention" (SOSP 2023); the free-queue and cached-block
design follows vLLM v1's ``BlockPool``.
"""

from __future__ import annotations


class KVCacheBlock:
    """Metadata of one KV cache block.

    ``ref_cnt`` counts the requests using the block; a block with
    ``ref_cnt == 0`` sits in the free queue. ``block_hash`` is reserved for
    prefix caching (None when the block is not full or not cached).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: object | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, O(1) popleft / append / remove.

    Blocks are popped from the head (least recently freed first), and freed
    blocks are appended at the tail, which gives LRU order for eviction once
    prefix caching keeps freed blocks' contents.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the first free block.

        Raises:
            ValueError: when the queue is empty.
        """
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free KV cache blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from the queue in O(1)."""
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail in O(1)."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head to tail (O(n); for tests and debugging)."""
        out = []
        cur = self._head.next_free
        while cur is not None and cur is not self._tail:
            out.append(cur)
            cur = cur.next_free
        return out


class BlockPool:
    """Owns every :class:`KVCacheBlock`; hands them out and takes them back.

    Args:
        num_blocks: total blocks, including the reserved null block 0.

    Raises:
        ValueError: if ``num_blocks < 2`` (the null block plus one usable block).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.enable_caching = enable_caching
        # block hash -> the block holding that content (full, computed blocks only)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0
        self.cache_version = 0  # bumped whenever the set of cached hashes changes

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks (ref_cnt becomes 1), O(1) each.

        Raises:
            ValueError: if fewer than ``num_blocks`` blocks are free (nothing is taken).
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {self.get_num_free_blocks()} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            self.num_evictions += 1
            self.cache_version += 1
        block.block_hash = None

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block cached under ``block_hash``, or None (O(1))."""
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take one more reference on cache-hit blocks; free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached_block_hash_to_block:
            self.cached_block_hash_to_block[block_hash] = block
            block.block_hash = block_hash
            self.cache_version += 1

    def cached_block_hashes(self) -> tuple[int, list[bytes]]:
        """``(cache_version, the hash of every cached block)``. Safe to call from another
        thread: ``list(dict)`` copies under the GIL; a change racing the copy shows as a
        new version at the next call."""
        version = self.cache_version
        return version, list(self.cached_block_hash_to_block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (only when no block is in use). Returns success."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.cache_version += 1
        return True

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go back to the free queue.

        Pass blocks in eviction order (the first to be reused first).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def get_usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

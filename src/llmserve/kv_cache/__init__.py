"""Paged KV cache bookkeeping (pure Python): blocks, the pool, prefix caching,
per-request block tables, and the host pool for swapping."""

from llmserve.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from llmserve.kv_cache.manager import KVCacheManager, PrefixCacheStats
from llmserve.kv_cache.prefix_cache import extend_block_hashes, hash_block_tokens

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheManager",
           "PrefixCacheStats", "extend_block_hashes", "hash_block_tokens"]

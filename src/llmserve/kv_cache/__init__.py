"""Paged KV cache bookkeeping (pure Python): blocks, the pool, per-request block tables."""

from llmserve.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from llmserve.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheManager"]

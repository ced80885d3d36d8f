"""The engine's side of the shared KV store (``--kv-store``): build the Redis client
for this model and layout, and after each step hand the blocks it computed to the
store's writer thread. Lookups and loads happen in the scheduler (``("load", ...)``
KV cache ops, ``kv_cache/manager.py``)."""

from __future__ import annotations

import logging

from llmserve.config import EngineConfig
from llmserve.kv_cache.kv_store import KVStoreLayout, RedisKVStore

logger = logging.getLogger(__name__)


def kv_store_layout(config: EngineConfig) -> KVStoreLayout:
    """What a stored block must match here: the model (name, quantization, device kind,
    deterministic mode), the KV dtype and the paged layout."""
    mc = config.model_config
    model_id = (f"{config.model}|arch={mc.architecture}"
                f"|quantization={config.extra.get('quantization', 'auto')}"
                f"|device={config.device.split(':')[0]}|deterministic={int(config.deterministic)}")
    # the KV cache dtype: a store written with int8 / fp8 pages (codes + scales) lives in
    # another namespace than a bfloat16 one and is never loaded at another dtype
    dtype = config.kv_cache_dtype
    if getattr(config.cache_config, "kv_key_quant", "per-token") == "per-channel":
        dtype = "int8_kc"  # another page layout: another namespace
    return KVStoreLayout(model_id=model_id, dtype=dtype,
                         block_size=config.cache_config.block_size,
                         num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
                         head_dim=mc.head_dim)


def build_kv_store(config: EngineConfig) -> RedisKVStore | None:
    """The store of ``config.cache_config.kv_store`` (None when unset).

    Raises:
        ValueError: prefix caching is off, a draft model drafts (its KV is not stored),
            or Redis cannot be reached.
    """
    cc = config.cache_config
    if cc.kv_store is None:
        return None
    if not cc.enable_prefix_caching:
        raise ValueError("kv_store needs prefix caching (drop --no-enable-prefix-caching)")
    spec = config.speculative_config
    if spec is not None and getattr(spec, "method", None) == "draft_model":
        raise ValueError("kv_store is not supported with a draft-model speculative config "
                         "(the draft's KV is not stored); use the ngram method or no store")
    store = RedisKVStore(cc.kv_store, kv_store_layout(config), ttl_s=cc.kv_store_ttl)
    logger.info("KV store: %s (namespace %s, %d bytes per block)", cc.kv_store,
                store.layout.namespace, store.layout.block_nbytes)
    return store


def write_new_blocks(kv_cache_manager, store: RedisKVStore, kv_caches) -> int:
    """Copy the blocks cached since the last call out of ``kv_caches`` and queue them
    for writing (as many as the queue takes; the rest are dropped). Returns the number
    queued. Runs on the engine thread right after a step, before any block is reused."""
    from llmserve.worker.kv_transfer import block_bodies, gather_blocks

    pairs = [(h, b) for h, b in kv_cache_manager.pop_newly_cached() if store.wants(h)]
    if not pairs:
        return 0
    room = store.room()
    if room < len(pairs):
        store.stats.writes_dropped += len(pairs) - room
        pairs = pairs[:room]
    if not pairs:
        return 0
    blocks = gather_blocks(kv_caches, [b for _, b in pairs])
    ok = store.put_async([h for h, _ in pairs], lambda: block_bodies(blocks))
    return len(pairs) if ok else 0

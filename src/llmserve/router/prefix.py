"""The engine's prefix-cache block hashes, computed in the router.

The router and the engine's prefix cache identify a prompt prefix the same way:
the chained SHA-256 block hashes of :mod:`llmserve.kv_cache.prefix_cache` (pure
Python, no torch) over the prompt's token ids, with the same ``block_size`` and
the same ``cache_salt`` handling as :class:`llmserve.scheduler.request.Request`
(``extra_keys = b"salt:" + salt``, entering the first block only).
"""

from __future__ import annotations

from llmserve.kv_cache.prefix_cache import extend_block_hashes, request_extra_keys


def salt_extra_keys(cache_salt: str | None, lora_int_id: int | None = None) -> bytes:
    """``extra_keys`` for a request's ``cache_salt`` and LoRA adapter id
    (:func:`~llmserve.kv_cache.prefix_cache.request_extra_keys`, as the scheduler)."""
    return request_extra_keys(cache_salt, lora_int_id)


def prompt_block_hashes(token_ids: list[int], block_size: int,
                        cache_salt: str | None = None,
                        lora_int_id: int | None = None) -> list[bytes]:
    """Hashes of the full ``block_size``-token blocks of ``token_ids`` (32 bytes each).

    Raises:
        ValueError: ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return extend_block_hashes([], list(token_ids), block_size,
                               request_extra_keys(cache_salt, lora_int_id))


def lora_name_extra_keys(token_ids: list[int], block_size: int, cache_salt: str | None,
                         lora_name: str) -> list[bytes]:
    """A LoRA request's worker-independent routing key: the chained hashes with the
    adapter's *name* in the first block's extra keys. No engine holds these (an
    engine salts with its own ``lora_int_id``, see :meth:`RouteRequest.hashes_for`);
    they key ``prefix_hash`` and workers that publish no adapter id.

    Raises:
        ValueError: ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    extra = b"lora-name:" + lora_name.encode() + b"\0" + request_extra_keys(cache_salt)
    return extend_block_hashes([], list(token_ids), block_size, extra)

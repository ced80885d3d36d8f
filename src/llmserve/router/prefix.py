"""The engine's prefix-cache block hashes, computed in the router.

The router and the engine's prefix cache identify a prompt prefix the same way:
the chained SHA-256 block hashes of :mod:`llmserve.kv_cache.prefix_cache` (pure
Python, no torch) over the prompt's token ids, with the same ``block_size`` and
the same ``cache_salt`` handling as :class:`llmserve.scheduler.request.Request`
(``extra_keys = b"salt:" + salt``, entering the first block only).
"""

from __future__ import annotations

from llmserve.kv_cache.prefix_cache import extend_block_hashes


def salt_extra_keys(cache_salt: str | None) -> bytes:
    """``extra_keys`` for a request's ``cache_salt`` (as ``scheduler.request.Request``)."""
    return b"" if cache_salt is None else b"salt:" + cache_salt.encode()


def prompt_block_hashes(token_ids: list[int], block_size: int,
                        cache_salt: str | None = None) -> list[bytes]:
    """Hashes of the full ``block_size``-token blocks of ``token_ids`` (32 bytes each).

    Raises:
        ValueError: ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return extend_block_hashes([], list(token_ids), block_size, salt_extra_keys(cache_salt))

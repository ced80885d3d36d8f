"""Block hashes for automatic prefix caching.

Each *full* block of a request's tokens is identified by a hash chained from
its parent block's hash::

    h_0 = SHA-256(SEED || extra_keys || tokens[0:B])
    h_i = SHA-256(h_{i-1} || tokens[i*B:(i+1)*B])

so equal hashes mean equal whole prefixes, not just equal blocks. The extra
keys (:func:`request_extra_keys`: the LoRA adapter's id and a per-request
``cache_salt``) enter the first block, so requests with different adapters (or none)
or salts never share cache (vLLM puts the LoRA id in the block hash's extra keys too). SHA-256 is a cryptographic hash: a
collision, which would return wrong KV, has probability about 2^-128 even
over billions of blocks, so tokens are not compared again on a hit (vLLM's
``sha256`` prefix-caching hash makes the same choice).
Source: vLLM v1 ``kv_cache_utils.hash_block_tokens``; SGLang RadixAttention
for the idea of reusing KV across requests.
"""

from __future__ import annotations

import hashlib
from array import array

_SEED = b"llmserve-prefix-cache-v1"


def request_extra_keys(cache_salt: str | None = None, lora_int_id: int | None = None) -> bytes:
    """The first block's extra keys of a request; the one function the engine's
    scheduler and the router both use.

    ``b""`` for neither; ``b"salt:" + salt`` for a salt alone; a LoRA adapter
    (``LoRARequest.lora_int_id``, which names one adapter for an engine's lifetime)
    puts a fixed-width ``b"lora:" + id (8 bytes)`` in front, so no salt can forge it.
    """
    keys = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    if lora_int_id is not None:
        keys = b"lora:" + int(lora_int_id).to_bytes(8, "little") + keys
    return keys


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...],
                      extra_keys: bytes = b"") -> bytes:
    """Hash of one full block given its parent's hash (None for the first block).

    Returns:
        32 bytes (SHA-256 digest).
    """
    h = hashlib.sha256()
    if parent_hash is None:
        h.update(_SEED)
        h.update(len(extra_keys).to_bytes(4, "little"))
        h.update(extra_keys)
    else:
        h.update(parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(block_hashes: list[bytes], token_ids: list[int], block_size: int,
                        extra_keys: bytes = b"") -> list[bytes]:
    """Append the hashes of the full blocks of ``token_ids`` not yet in ``block_hashes``.

    Mutates and returns ``block_hashes`` (incremental: O(new blocks)).
    """
    num_full = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[i - 1] if i else None
        block_hashes.append(hash_block_tokens(
            parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys))
    return block_hashes

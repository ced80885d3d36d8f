"""Paged KV blocks to bytes and back, for the shared KV store (``kv_cache/kv_store.py``).

One block's bytes are every layer's key and value of that block, as the paged
cache holds them::

    body = per layer: its key block's bytes, then its value block's (cache dtype, C order)
           = [num_layers, 2, block_size, num_kv_heads, head_dim] when the two match

``gather_blocks`` copies blocks out (on the engine thread, right after the step
that computed them: the copy must happen before the block can be reused);
the bytes are taken from that copy on the store's writer thread. ``fill_blocks``
is the runner's ``("load", body, block_id)`` KV cache op: it writes bodies
fetched from the store into freshly allocated blocks before the forward pass.
"""

from __future__ import annotations

import numpy as np
import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def _block_bytes(kv_caches: KVCaches) -> tuple[int, int]:
    """Bytes of one block of a layer's key cache and of its value cache (the shapes differ
    with per-channel int8 keys: kv_quant_pc.py)."""
    kc0, vc0 = kv_caches[0]
    return (kc0.shape[1:].numel() * kc0.element_size(),
            vc0.shape[1:].numel() * vc0.element_size())


def gather_blocks(kv_caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """A CPU copy of blocks ``block_ids``: ``[n, num_layers, key bytes + value bytes]``
    uint8 (each layer's key block, then its value block, in the cache's bytes)."""
    kc0 = kv_caches[0][0]
    kb, vb = _block_bytes(kv_caches)
    idx = torch.tensor(block_ids, dtype=torch.long, device=kc0.device)
    out = torch.empty((len(block_ids), len(kv_caches), kb + vb), dtype=torch.uint8)
    for layer, (kc, vc) in enumerate(kv_caches):
        out[:, layer, :kb].copy_(kc.index_select(0, idx).cpu().reshape(len(block_ids), -1)
                                 .view(torch.uint8))
        out[:, layer, kb:].copy_(vc.index_select(0, idx).cpu().reshape(len(block_ids), -1)
                                 .view(torch.uint8))
    return out


def block_bodies(blocks: torch.Tensor) -> list[memoryview]:
    """The bytes of each block of a :func:`gather_blocks` result (no copy)."""
    flat = blocks.reshape(blocks.shape[0], -1).view(torch.uint8).numpy()  # [n, nbytes]
    return [memoryview(row) for row in flat]


def fill_blocks(kv_caches: KVCaches, bodies: list, block_ids: list[int]) -> None:
    """Write block bodies (bytes-like, :func:`gather_blocks` layout) into ``block_ids``.

    Raises:
        ValueError: a body's length is not one block of this cache.
    """
    kc0, vc0 = kv_caches[0]
    kb, vb = _block_bytes(kv_caches)
    nbytes = len(kv_caches) * (kb + vb)
    if any(len(b) != nbytes for b in bodies):
        raise ValueError(f"kv store block is not {nbytes} bytes")
    buf = np.empty((len(bodies), nbytes), dtype=np.uint8)  # one copy out of the bodies
    for row, body in zip(buf, bodies):
        row[:] = np.frombuffer(body, dtype=np.uint8)
    blocks = torch.from_numpy(buf).view(len(bodies), len(kv_caches), kb + vb)
    idx = torch.tensor(block_ids, dtype=torch.long, device=kc0.device)
    for layer, (kc, vc) in enumerate(kv_caches):
        keys = blocks[:, layer, :kb].contiguous().view(kc.dtype).view(len(bodies), *kc.shape[1:])
        values = blocks[:, layer, kb:].contiguous().view(vc.dtype).view(len(bodies),
                                                                        *vc.shape[1:])
        kc.index_copy_(0, idx, keys.to(kc.device))
        vc.index_copy_(0, idx, values.to(vc.device))

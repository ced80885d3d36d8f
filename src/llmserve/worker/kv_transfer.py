"""Paged KV blocks to bytes and back, for the shared KV store (``kv_cache/kv_store.py``).

One block's bytes are every layer's key and value of that block, as the paged
cache holds them::

    body = [num_layers, 2 (key, value), block_size, num_kv_heads, head_dim]  (cache dtype, C order)

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


def gather_blocks(kv_caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """A CPU copy of blocks ``block_ids``: ``[n, num_layers, 2, block_size, kv_heads, head_dim]``."""
    kc0 = kv_caches[0][0]
    idx = torch.tensor(block_ids, dtype=torch.long, device=kc0.device)
    out = torch.empty((len(block_ids), len(kv_caches), 2, *kc0.shape[1:]), dtype=kc0.dtype)
    for layer, (kc, vc) in enumerate(kv_caches):
        out[:, layer, 0].copy_(kc.index_select(0, idx))
        out[:, layer, 1].copy_(vc.index_select(0, idx))
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
    kc0 = kv_caches[0][0]
    block_shape = kc0.shape[1:]  # [block_size, kv_heads, head_dim]
    nbytes = len(kv_caches) * 2 * block_shape.numel() * kc0.element_size()
    if any(len(b) != nbytes for b in bodies):
        raise ValueError(f"kv store block is not {nbytes} bytes")
    buf = np.empty((len(bodies), nbytes), dtype=np.uint8)  # one copy out of the bodies
    for row, body in zip(buf, bodies):
        row[:] = np.frombuffer(body, dtype=np.uint8)
    # [n, num_layers, 2, block_size, kv_heads, head_dim]
    blocks = torch.from_numpy(buf).view(kc0.dtype).view(
        len(bodies), len(kv_caches), 2, *block_shape).to(kc0.device)
    idx = torch.tensor(block_ids, dtype=torch.long, device=kc0.device)
    for layer, (kc, vc) in enumerate(kv_caches):
        kc.index_copy_(0, idx, blocks[:, layer, 0])
        vc.index_copy_(0, idx, blocks[:, layer, 1])

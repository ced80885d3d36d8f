"""The runner's side of a mixed model's window pool (``kv_cache/window_blocks.py``).

The local layers' key/value caches are ``[window pool blocks, block_size, kv_heads,
head_dim]``; each step gets their own block table and slots, built here from each
request's ``(first logical block, window-pool ids)``::

    logical block:        0  1  2  3  4  5  6
    block_table row:     [7, 3, 9, 12, 4, 8, 11]     (global layers)
    window table row:    [0, 0, 2, 6, 1, 5, 0]      (local layers; first = 2; 0: null)
    slot of position p:  ids[p // block_size - first] * block_size + p % block_size
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from llmserve.kv_cache.window_blocks import WindowKVLayout, cap_window_pool
from llmserve.layers.attention.backend import WindowLayout
from llmserve.planner.ledger import kv_bytes_per_token_per_layer
from llmserve.scheduler.kv_limits import window_kv_for
from llmserve.utils import format_size

logger = logging.getLogger("llmserve")


def resolve_window_kv(config) -> tuple[WindowKVLayout | None, str, int, int]:
    """The engine's window pool: ``(layout or None, why not, KV bytes per token of the
    paged pool's layers, bytes of the window pool)``, for this rank's KV heads. Engine
    and runner (every tensor-parallel rank) call it with the same config."""
    mc, cc = config.model_config, config.cache_config
    per_layer = kv_bytes_per_token_per_layer(
        mc, config.kv_cache_dtype, config.parallel_config.tensor_parallel_size,
        cc.kv_key_quant, cc.block_size)
    layout, why_not = window_kv_for(config)
    if layout is None:
        return None, why_not, per_layer * mc.num_hidden_layers, 0
    num_local = len(layout.layers)
    per_block = cc.block_size * per_layer * num_local
    layout = cap_window_pool(layout, per_block, cc.kv_cache_memory)
    return (layout, "", per_layer * (mc.num_hidden_layers - num_local),
            layout.num_blocks * per_block)


def split_kv_memory(config, kv_bytes_per_token: int,
                    ) -> tuple[WindowKVLayout | None, int, int]:
    """``(window pool layout or None, bytes left for the paged pool, its bytes per
    token)`` out of ``--kv-cache-memory``; logs the split (or why there is none)."""
    layout, why_not, paged_bytes, window_bytes = resolve_window_kv(config)
    memory = config.cache_config.kv_cache_memory
    if layout is None:
        if why_not:
            logger.info("local layers keep every block: %s", why_not)
        return None, memory, kv_bytes_per_token
    logger.info("local layers (window %d) keep their KV in a window pool: %d blocks (%s); "
                "the paged pool holds the global layers' %d B/token", layout.window,
                layout.num_blocks, format_size(window_bytes), paged_bytes)
    return layout, memory - window_bytes, paged_bytes


def window_rows(states: list, positions: list[np.ndarray], width: int, block_size: int,
                ) -> tuple[np.ndarray, np.ndarray]:
    """``(window table [num_seqs, width] int64, slots [num_tokens] int64)`` for the
    step's requests ``states`` (each with ``window_blocks``) and each one's query
    ``positions``.

    Raises:
        ValueError: a request without window blocks, or a position outside its blocks.
    """
    table = np.zeros((len(states), width), dtype=np.int64)
    slots = []
    for i, (state, pos) in enumerate(zip(states, positions, strict=True)):
        if state.window_blocks is None:
            raise ValueError(f"request {state.req_id!r} has no window-pool blocks")
        first, ids = state.window_blocks
        ids = np.asarray(ids, dtype=np.int64)
        table[i, first:first + len(ids)] = ids
        index = pos // block_size - first
        if len(pos) and (index.min() < 0 or index.max() >= len(ids)):
            raise ValueError(f"request {state.req_id!r}: positions {pos[0]}..{pos[-1]} lie "
                             f"outside its window blocks {first}..{first + len(ids) - 1}")
        slots.append(ids[index] * block_size + pos % block_size)
    return table, np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)


def window_layout(window: int, table: np.ndarray, slots: np.ndarray,
                  device: torch.device) -> WindowLayout:
    """The step's :class:`WindowLayout` from :func:`window_rows`' arrays."""
    return WindowLayout(window, torch.from_numpy(table).to(device),
                        torch.from_numpy(slots).to(device))

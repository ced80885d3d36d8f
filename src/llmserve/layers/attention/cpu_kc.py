"""Per-channel int8 keys in the ``"cpu"`` backend (``kv_quant_pc.py``): which steps run
token by token, and the per-token tables they run with.

A step whose tokens each write a block no other token of the step writes (a decode batch
of distinct sequences) keeps the one-call path: write all K/V, then one decode kernel.
Any other step (a prompt chunk, ``--deterministic``'s per-token decodes, speculative
tokens) runs every token as write-then-attend, in token order, over its own context::

    tokens     [ d0 d1 | p0 p0 p0 p1 ]
    tables     [ decode_block_table rows | quant_prefill rows ]   padded to one width
    seq_lens   [ decode_seq_lens        | position + 1       ]
"""

from __future__ import annotations

import torch

from llmserve.layers.attention.kv_quant_pc import sequential_attention


def needs_sequential(metadata, block_size: int) -> bool:
    """True unless every token of the step writes a block of its own (once per step)."""
    cached = getattr(metadata, "_kc_sequential", None)
    if cached is None:
        blocks = metadata.slot_mapping[metadata.slot_mapping >= 0] // block_size
        cached = bool(metadata.num_prefills) or int(blocks.unique().numel()) < blocks.numel()
        metadata._kc_sequential = cached
    return cached


def _token_tables(metadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_table [T, W], seq_lens [T]) of every token of the step, in token order."""
    from llmserve.layers.attention.cpu import _quant_prefill_tables

    cached = getattr(metadata, "_kc_tables", None)
    if cached is not None:
        return cached
    tables, lens = [], []
    if metadata.num_decodes:
        tables.append(metadata.decode_block_table)
        lens.append(metadata.decode_seq_lens)
    if metadata.num_prefills:
        if metadata.quant_prefill is None:
            metadata.quant_prefill = _quant_prefill_tables(metadata.prefills)
        tables.append(metadata.quant_prefill[0])
        lens.append(metadata.quant_prefill[1])
    width = max(t.shape[1] for t in tables)
    tables = [t if t.shape[1] == width else torch.cat(
        [t, t.new_zeros(t.shape[0], width - t.shape[1])], 1) for t in tables]
    cached = torch.cat(tables).contiguous(), torch.cat(lens).contiguous()
    metadata._kc_tables = cached
    return cached


def forward_sequential(backend, kernels, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, metadata) -> torch.Tensor:
    """Every token of the step: write its K/V, then attend (C kernel, else PyTorch).

    Returns ``[num_tokens, num_heads, head_dim]`` in the query dtype.
    """
    block_table, seq_lens = _token_tables(metadata)
    slots = metadata.slot_mapping
    if kernels is not None and key_cache.is_cpu and query.dtype in (torch.float32,
                                                                   torch.bfloat16) \
            and key.dtype == query.dtype and value.dtype == query.dtype \
            and query.stride(1) == backend.head_dim and key.stride()[1:] == (key.shape[2], 1) \
            and value.stride()[1:] == (value.shape[2], 1):
        from llmserve.kernels.cpu_kvc import paged_prefill_quant_kc

        return paged_prefill_quant_kc(kernels, query, key, value, key_cache, value_cache,
                                      slots, block_table, seq_lens, backend.scale,
                                      metadata.sliding_window, torch.get_num_threads())
    return sequential_attention(query, key, value, key_cache, value_cache, slots,
                                block_table, seq_lens, backend.scale, metadata.sliding_window)

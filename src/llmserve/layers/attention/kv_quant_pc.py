"""KIVI-style per-channel int8 keys in paged KV blocks (``--kv-key-quant per-channel``).

KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
ICML 2024) quantizes keys per channel and values per token: key outliers sit in a few
fixed channels, so a per-token scale is set by the outlier and crushes the other
channels, while a per-channel scale isolates it. KIVI groups G tokens per channel scale
and keeps the last R (< G) tokens in full precision until a group fills. Our pages hold
one byte per element in a fixed block layout, and a float residual of a block's tokens
would need 2-4x the block's own bytes outside it (a second pool that swap, copy-on-write,
prefix caching and the KV store would all have to move). So a block is the group and its
scale is a *running* absmax instead:

    key_cache:   [num_blocks, block_size + 2, num_kv_heads, head_dim]   int8
                 rows 0 .. bs-1: codes c[o, h, d] of the token at block offset o
                 rows bs, bs+1:  2 * Hkv * D bytes = fp16 scales s[h, d] (little endian)
    value_cache: [num_blocks, block_size, num_kv_heads, head_dim + 2]   int8, per token
                 (kv_quant.py: codes then that row's fp16 scale)

Writing key ``x[h, d]`` at block offset ``o`` (tokens are written in position order):

    o == 0:           s = fp16(min(|x| / 127, 65504))       (the block starts afresh)
    else: n = fp16(min(|x| / 127, 65504));  if n > s:        (the channel's range grows)
                      c[o', h, d] = rint((c[o'] * s) / n)  for o' < o,  s = n
    c[o, h, d] = clamp(rint(x / s), -127, 127)   (0 where s == 0)

so each block's scale is its running per-channel absmax / 127 and the earlier codes of a
grown channel are re-rounded in place (each re-rounding adds at most half a step of the
new, larger grid). The scales live inside the block, so swap, copy-on-write and the KV
store, which move whole blocks along dim 0, carry them. Attention reads a block's scales
once: ``score_j = scale * sum_d (q_d * s_d) * c[j, d]`` (q scaled once per block).

A token must see the cache as it stood right after its own write (a later token of the
same block may grow a scale and re-round the codes), so prompts and any step where two
tokens write one block run token by token: write, then attend (the C kernel
``paged_prefill_quant_kc``; :func:`sequential_attention` here). A token's result is then a
function of its position and context only, as with per-token pages: chunking and prefix
caching change nothing. Not covered: a rejected speculative token has already grown its
block's scales when its slot is rewritten (a little precision lost, never wrong values).
"""

from __future__ import annotations

import torch

SCALE_ROWS = 2  # fp16 scales of a block: 2 * Hkv * D bytes = two token rows


def is_per_channel_key_cache(cache: torch.Tensor, head_dim: int) -> bool:
    """True for a per-channel int8 key cache (rows of ``head_dim`` codes, no row scale)."""
    return cache.dtype == torch.int8 and cache.shape[-1] == head_dim


def block_scales(blocks: torch.Tensor) -> torch.Tensor:
    """``[N, bs + 2, Hkv, D]`` int8 key blocks -> their scales ``[N, Hkv, D]`` float32."""
    n, rows, hkv, d = blocks.shape
    raw = blocks[:, rows - SCALE_ROWS:].contiguous().view(n, SCALE_ROWS * hkv * d)
    return raw.view(torch.float16).view(n, hkv, d).float()


def dequantize_key_blocks(blocks: torch.Tensor, dtype: torch.dtype = torch.float32
                          ) -> torch.Tensor:
    """``[N, bs + 2, Hkv, D]`` int8 key blocks -> ``[N, bs, Hkv, D]`` keys (codes * scale)."""
    codes = blocks[:, :blocks.shape[1] - SCALE_ROWS].float()
    return (codes * block_scales(blocks)[:, None]).to(dtype)


def _fp16_scale(x: torch.Tensor) -> torch.Tensor:
    return (x.abs() / 127.0).clamp(max=65504.0).to(torch.float16).float()


def write_key_per_channel(key: torch.Tensor, key_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Write ``key`` ``[T, Hkv, D]`` token by token (slot ``-1`` skips) into a per-channel
    key cache (module docstring); the PyTorch reference of the C kernel, same bytes."""
    num_blocks, rows, hkv, d = key_cache.shape
    bs = rows - SCALE_ROWS
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, bs)
        block = key_cache[blk]  # [bs + 2, Hkv, D]
        x = key[t].float()
        new = _fp16_scale(x)
        scales = block[bs:].contiguous().view(torch.float16).view(hkv, d).float()
        if off == 0:
            s = new
        else:
            grow = new > scales
            s = torch.where(grow, new, scales)
            if bool(grow.any()):
                old = block[:off].float()
                ratio_safe = torch.where(grow, s, torch.ones_like(s))
                rescaled = torch.round((old * scales) / ratio_safe).clamp(-127, 127)
                block[:off] = torch.where(grow, rescaled, old).to(torch.int8)
        safe = torch.where(s == 0, torch.ones_like(s), s)
        code = torch.round(x / safe).clamp(-127, 127)
        block[off] = torch.where(s == 0, torch.zeros_like(code), code).to(torch.int8)
        block[bs:] = s.to(torch.float16).view(torch.int8).view(SCALE_ROWS, hkv, d)


def write_kv_per_channel(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Per-channel keys (:func:`write_key_per_channel`), per-token int8 values."""
    from llmserve.layers.attention.kv_quant import quantize_kv

    write_key_per_channel(key, key_cache, slot_mapping)
    num_kv_heads, row = value_cache.shape[-2:]
    keep = slot_mapping >= 0
    value_cache.view(-1, num_kv_heads, row).index_copy_(
        0, slot_mapping[keep], quantize_kv(value[keep], "int8"))


def sequential_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         key_cache: torch.Tensor, value_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float,
                         window: int | None = None) -> torch.Tensor:
    """Token by token: write token ``t``'s K/V, then attend its query over its context.

    Args:
        query: ``[T, H, D]``; key, value: ``[T, Hkv, D]``; slot_mapping: ``[T]``.
        block_table: ``[T, W]`` int64, each token's sequence's blocks; seq_lens: ``[T]``
            (its position + 1).

    Returns:
        ``[T, H, D]`` in the query dtype (float32 math). The PyTorch reference (and
        fallback) of the C kernel ``paged_prefill_quant_kc``.
    """
    from llmserve.layers.attention.kv_quant import dequantize_kv

    num_tokens, num_heads, _ = query.shape
    group = num_heads // key.shape[1]
    out = torch.empty_like(query)
    for t in range(num_tokens):
        write_kv_per_channel(key[t:t + 1], value[t:t + 1], key_cache, value_cache,
                             slot_mapping[t:t + 1])
        n = int(seq_lens[t])
        blocks = block_table[t, :(n + value_cache.shape[1] - 1) // value_cache.shape[1]]
        k = dequantize_key_blocks(key_cache[blocks]).flatten(0, 1)[:n]
        v = dequantize_kv(value_cache[blocks]).flatten(0, 1)[:n]
        if window is not None:
            k, v = k[max(0, n - window):], v[max(0, n - window):]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", query[t].float(), k) * scale
        out[t] = torch.einsum("hk,khd->hd", scores.softmax(-1), v).to(query.dtype)
    return out

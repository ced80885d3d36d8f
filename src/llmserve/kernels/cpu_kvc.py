"""Typed wrappers over the per-channel int8 key kernels of ``cpu_kernels_kvc.c``.

Layout (``layers/attention/kv_quant_pc.py``): key cache ``[num_blocks, bs + 2, Hkv, D]``
int8 (codes, then the block's fp16 per-channel scales), value cache
``[num_blocks, bs, Hkv, D + 2]`` int8 (per-token rows). :class:`CpuKernels` routes an
``"int8"`` call whose key cache rows have no scale bytes here.
"""

from __future__ import annotations

import torch

from llmserve.kernels.cpu import CpuKernels, _code, check_status


def _check_caches(what: str, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  num_kv_heads: int, head_dim: int) -> int:
    """The block size; ValueError unless the two caches have the per-channel layout."""
    nb, rows, hkv, d = key_cache.shape
    bs = value_cache.shape[1]
    if key_cache.dtype != torch.int8 or value_cache.dtype != torch.int8 or \
            (hkv, d) != (num_kv_heads, head_dim) or rows != bs + 2 or \
            tuple(value_cache.shape) != (nb, bs, hkv, d + 2) or \
            not (key_cache.is_cpu and value_cache.is_cpu) or \
            not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError(f"{what}: per-channel key cache [blocks, bs + 2, {num_kv_heads}, "
                         f"{head_dim}] and value cache [blocks, bs, {num_kv_heads}, "
                         f"{head_dim + 2}] (int8, CPU, contiguous) needed, got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    return bs


def _check_kv(what: str, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    num_tokens, _, head_dim = key.shape
    if key.stride()[1:] != (head_dim, 1) or value.stride()[1:] != (head_dim, 1) or \
            value.shape != key.shape or slot_mapping.dtype != torch.int64 or \
            slot_mapping.numel() != num_tokens or not slot_mapping.is_contiguous() or \
            not slot_mapping.is_cpu:
        raise ValueError(f"{what}: K/V {tuple(key.shape)} strides {key.stride()} / "
                         f"{value.stride()}, slot_mapping {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")


def _check_tables(what: str, num_rows: int, block_table: torch.Tensor,
                  seq_lens: torch.Tensor) -> None:
    if block_table.dtype != torch.int64 or seq_lens.dtype != torch.int64 or \
            block_table.shape[0] != num_rows or block_table.stride(1) != 1 or \
            seq_lens.shape != (num_rows,) or not seq_lens.is_contiguous() or \
            not (block_table.is_cpu and seq_lens.is_cpu):
        raise ValueError(f"{what}: int64 CPU block_table [S, B] (rows contiguous) and "
                         f"seq_lens [S] needed")


def write_kv_quant_kc(k: CpuKernels, key: torch.Tensor, value: torch.Tensor,
                      key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` (float32/bfloat16) token by token at
    ``slot_mapping`` ``[T]`` (``-1`` skips): per-channel running-absmax keys, per-token
    int8 values.

    Raises:
        ValueError: mismatched layouts or a slot outside the cache.
    """
    _check_kv("write_kv_quant_kc", key, value, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    bs = _check_caches("write_kv_quant_kc", key_cache, value_cache, num_kv_heads, head_dim)
    check_status(k._write_kv_quant_kc(
        _code(key, value), key_cache.data_ptr(), value_cache.data_ptr(), key_cache.shape[0],
        bs, key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
        slot_mapping.data_ptr(), num_tokens, num_kv_heads, head_dim), "write_kv_quant_kc")


def paged_attention_decode_quant_kc(k: CpuKernels, query: torch.Tensor,
                                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                                    block_table: torch.Tensor, seq_lens: torch.Tensor,
                                    scale: float, sliding_window: int | None = None,
                                    num_threads: int = 1) -> torch.Tensor:
    """:meth:`CpuKernels.paged_attention_decode` over a per-channel key cache (K/V of
    the query tokens already written). Returns ``[S, H, D]`` in the query dtype.

    Raises:
        ValueError: as :meth:`CpuKernels.paged_attention_decode`.
    """
    num_seqs, num_heads, head_dim = query.shape
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        raise ValueError(f"paged_attention_decode_quant_kc: query strides {query.stride()}")
    bs = _check_caches("paged_attention_decode_quant_kc", key_cache, value_cache,
                       key_cache.shape[2], head_dim)
    _check_tables("paged_attention_decode_quant_kc", num_seqs, block_table, seq_lens)
    out = query.new_empty((num_seqs, num_heads, head_dim))
    check_status(k._paged_attention_decode_quant_kc(
        _code(query), out.data_ptr(), query.data_ptr(), query.stride(0), key_cache.data_ptr(),
        value_cache.data_ptr(), key_cache.shape[0], block_table.data_ptr(),
        block_table.shape[1], block_table.stride(0), seq_lens.data_ptr(), num_seqs, num_heads,
        key_cache.shape[2], head_dim, bs, scale, sliding_window or 0, num_threads),
        "paged_attention_decode_quant_kc")
    return out


def paged_prefill_quant_kc(k: CpuKernels, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None,
                           num_threads: int = 1) -> torch.Tensor:
    """Token by token: write token ``t``'s K/V (``[T, Hkv, D]``) at ``slot_mapping[t]``,
    then attend ``query[t]`` (``[T, H, D]``) over block_table row ``t`` and ``seq_lens[t]``
    (its position + 1); ``kv_quant_pc.sequential_attention`` is the reference.

    Returns:
        ``[T, H, D]`` in the query dtype.

    Raises:
        ValueError: mismatched layouts, a slot or block outside the cache.
    """
    num_tokens, num_heads, head_dim = query.shape
    _check_kv("paged_prefill_quant_kc", key, value, slot_mapping)
    if query.stride(2) != 1 or query.stride(1) != head_dim or key.shape[0] != num_tokens \
            or key.shape[2] != head_dim:
        raise ValueError(f"paged_prefill_quant_kc: query {tuple(query.shape)} strides "
                         f"{query.stride()}, K/V {tuple(key.shape)}")
    bs = _check_caches("paged_prefill_quant_kc", key_cache, value_cache, key.shape[1],
                       head_dim)
    _check_tables("paged_prefill_quant_kc", num_tokens, block_table, seq_lens)
    out = query.new_empty((num_tokens, num_heads, head_dim))
    check_status(k._paged_prefill_quant_kc(
        _code(query, key, value), out.data_ptr(), query.data_ptr(), query.stride(0),
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
        slot_mapping.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        key_cache.shape[0], block_table.data_ptr(), block_table.shape[1],
        block_table.stride(0), seq_lens.data_ptr(), num_tokens, num_heads, key.shape[1],
        head_dim, bs, scale, sliding_window or 0, num_threads), "paged_prefill_quant_kc")
    return out

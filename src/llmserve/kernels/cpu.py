"""Typed wrappers over the C kernels of ``cpu_kernels.c`` (see the package docstring).

Each wrapper checks what the C code relies on (dtype, device, contiguous last
dimension, matching shapes) and raises ``ValueError`` otherwise; the layers call
:meth:`CpuKernels.supports` first and fall back to PyTorch for anything else
(CUDA tensors, float16).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from llmserve.kernels.cpu_abi import (  # noqa: F401 - DTYPE_CODES etc. re-exported
    _SIGNATURES,
    DTYPE_CODES,
    GGUF_MATMUL_TYPES,
    KV_QUANT_FORMATS,
    _code,
    check_status,
)
from llmserve.kernels.cpu_gguf import GgufMatmulKernels


@dataclass
class BlockScoreArrays:
    """Per-sequence block score accumulators for the decode kernels (KV eviction by
    attention: H2O, Zhang et al. 2023; SnapKV, Li et al. 2024). Build it with
    :meth:`CpuKernels.block_score_arrays`; it keeps the arrays alive.

    ``ptrs`` ``[S]`` int64: each array's address, 0 for a sequence that is not scored;
    ``lens`` ``[S]`` int64: its length in blocks.
    """

    ptrs: torch.Tensor
    lens: torch.Tensor
    arrays: list[torch.Tensor | None]

    def ptr_args(self, num_seqs: int, what: str) -> tuple[int, int]:
        """``(ptrs, lens)`` addresses for a call over ``num_seqs`` sequences."""
        if self.ptrs.shape != (num_seqs,):
            raise ValueError(f"{what}: block scores for {self.ptrs.shape[0]} sequences, "
                             f"the call has {num_seqs}")
        return self.ptrs.data_ptr(), self.lens.data_ptr()


class CpuKernels(GgufMatmulKernels):
    """The C kernels of one loaded library. All tensors: CPU, float32 or bfloat16.

    The wrappers are on the hot path of every layer (a few us matter), so they check
    what memory safety needs (dtype, device, strides, extents) and leave the rest to
    the C side, which validates sizes and ids and returns a status.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            setattr(self, f"_{name}", fn)

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """True for a CPU float32 / bfloat16 tensor whose last dimension is contiguous."""
        return x.is_cpu and x.dtype in DTYPE_CODES and x.stride(-1) == 1

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of ``x`` ``[T, H]`` (rows may be strided); with ``residual``
        ``[T, H]`` returns ``(norm(x + residual), x + residual)`` (new tensors)."""
        num_tokens, hidden = x.shape
        if x.stride(1) != 1 or weight.shape != (hidden,) or not weight.is_contiguous():
            raise ValueError(f"rms_norm: x {tuple(x.shape)} strides {x.stride()} with weight "
                             f"{tuple(weight.shape)}")
        if residual is None:
            return self.rms_norm_unchecked(_code(x, weight), x, weight, eps, None)[0]
        if residual.shape != x.shape or not residual.is_contiguous():
            raise ValueError(f"rms_norm: residual {tuple(residual.shape)} must be a contiguous "
                             f"{tuple(x.shape)}")
        return self.rms_norm_unchecked(_code(x, weight, residual), x, weight, eps, residual)

    def rms_norm_unchecked(self, code: int, x: torch.Tensor, weight: torch.Tensor, eps: float,
                           residual: torch.Tensor | None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`rms_norm` without its checks, for callers that made them once per step
        (the CPU decode path): ``(norm(x [+ residual]), x + residual or None)``."""
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        res_out = None if residual is None else torch.empty_like(out)
        check_status(self._rms_norm(
            code, out.data_ptr(), x.data_ptr(), x.stride(0),
            None if residual is None else residual.data_ptr(),
            None if res_out is None else res_out.data_ptr(), weight.data_ptr(), x.shape[0],
            x.shape[1], eps), "rms_norm")
        return out, res_out

    def rotary_emb_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate ``x`` ``[T, heads, head_dim]`` in place (rotate_half layout) by
        ``cos``/``sin`` ``[T, head_dim / 2]`` or ``[T, 1, head_dim / 2]`` (contiguous)."""
        num_tokens, heads, head_dim = x.shape
        if x.stride(2) != 1 or cos.numel() != num_tokens * (head_dim // 2) or \
                sin.shape != cos.shape or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"rotary_emb_: x {tuple(x.shape)} strides {x.stride()}, cos/sin "
                             f"{tuple(cos.shape)} (contiguous, [T, head_dim / 2])")
        code = _code(x, cos, sin)
        check_status(self._rotary_emb(code, x.data_ptr(), num_tokens, heads, head_dim,
                                x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr()),
               "rotary_emb")

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[T, Hkv, D]`` (heads contiguous within a token) at
        ``slot_mapping`` ``[T]`` int64 (``-1`` skips) of caches ``[blocks, bs, Hkv, D]``.

        Raises:
            ValueError: a slot outside the cache, or mismatched layouts.
        """
        num_tokens, num_kv_heads, head_dim = key.shape
        row = num_kv_heads * head_dim
        # a token's heads contiguous: strides (any, head_dim, 1) for K and V
        if key.stride()[1:] != (head_dim, 1) or value.stride()[1:] != (head_dim, 1) or \
                value.shape != key.shape or value_cache.shape != key_cache.shape or \
                key_cache.shape[2] * key_cache.shape[3] != row or \
                not (key_cache.is_contiguous() and value_cache.is_contiguous()) or \
                slot_mapping.dtype != torch.int64 or slot_mapping.numel() != num_tokens or \
                not slot_mapping.is_contiguous():
            raise ValueError(f"write_kv: K/V {tuple(key.shape)} strides {key.stride()} and "
                             f"{value.stride()}, caches {tuple(key_cache.shape)}, slot_mapping "
                             f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
        code = _code(key, value, key_cache, value_cache)
        check_status(self._write_kv(code, key_cache.data_ptr(), value_cache.data_ptr(),
                              key_cache.numel() // row, key.data_ptr(), key.stride(0),
                              value.data_ptr(), value.stride(0), slot_mapping.data_ptr(),
                              num_tokens, row), "write_kv")

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, 2 d]`` = ``[gate | up]`` (contiguous) -> ``silu(gate) * up`` ``[T, d]``."""
        num_tokens, width = x.shape
        if width % 2 or not x.is_contiguous():
            raise ValueError(f"silu_and_mul: x must be a contiguous [T, 2 * d], got "
                             f"{tuple(x.shape)} strides {x.stride()}")
        code = _code(x)
        out = x.new_empty((num_tokens, width // 2))
        check_status(self._silu_and_mul(code, out.data_ptr(), x.data_ptr(), num_tokens, width // 2),
               "silu_and_mul")
        return out

    @staticmethod
    def block_score_arrays(arrays: list[torch.Tensor | None]) -> BlockScoreArrays:
        """The ``block_scores`` argument of the decode kernels: per sequence a float32 CPU
        contiguous ``[>= num_blocks]`` accumulator (one entry per block of its block
        table), or None for a sequence that is not scored. The arrays must not overlap.

        Raises:
            ValueError: an array of another dtype, device, rank or layout.
        """
        for t in arrays:
            if t is not None and (t.dtype != torch.float32 or not t.is_cpu or t.dim() != 1
                                  or not t.is_contiguous()):
                raise ValueError(f"block scores must be contiguous 1-D float32 CPU tensors, "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device}")
        ptrs = torch.tensor([0 if t is None else t.data_ptr() for t in arrays],
                            dtype=torch.int64)
        lens = torch.tensor([0 if t is None else t.numel() for t in arrays], dtype=torch.int64)
        return BlockScoreArrays(ptrs, lens, list(arrays))

    def paged_attention_decode(self, query: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, block_table: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None,
                               num_threads: int = 1,
                               block_scores: BlockScoreArrays | None = None) -> torch.Tensor:
        """Attention of one query token per sequence over its paged context.

        Args:
            query: ``[S, H, D]``, heads contiguous within a token (rows may be strided).
            key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` contiguous.
            block_table: ``[S, max_blocks]`` int64 (rows may be strided); seq_lens:
                ``[S]`` int64, the context length including the query token (its K/V
                already written).
            scale: score scale (``head_dim ** -0.5``); sliding_window: keys within the
                last ``window`` positions only; num_threads: split over threads when large.
            block_scores: optional accumulators (:meth:`block_score_arrays`): for each
                scored sequence, ``scores[b] +=`` the softmax probability its query heads
                put on block ``b``'s attended keys, summed over the heads (from the
                kernel's own split-K softmax: ``cpu_kernels_attn_scores.c``).

        Returns:
            ``[S, H, D]`` in the query dtype (float32 softmax and accumulation).

        Raises:
            ValueError: a block id outside the cache, a seq_len beyond its block table,
                a score array too short, or mismatched shapes.
        """
        num_seqs, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        if query.stride(2) != 1 or query.stride(1) != head_dim or \
                key_cache.shape[3] != head_dim or value_cache.shape != key_cache.shape or \
                not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError(f"paged_attention_decode: query {tuple(query.shape)} strides "
                             f"{query.stride()}, caches {tuple(key_cache.shape)} (contiguous)")
        if block_table.dtype != torch.int64 or seq_lens.dtype != torch.int64 or \
                block_table.shape[0] != num_seqs or block_table.stride(1) != 1 or \
                seq_lens.shape != (num_seqs,) or not seq_lens.is_contiguous() or \
                not (block_table.is_cpu and seq_lens.is_cpu):
            raise ValueError("paged_attention_decode: int64 CPU block_table [S, B] (rows "
                             "contiguous) and seq_lens [S] needed")
        code = _code(query, key_cache, value_cache)
        ptrs, lens = (None, None) if block_scores is None else \
            block_scores.ptr_args(num_seqs, "paged_attention_decode")
        out = query.new_empty((num_seqs, num_heads, head_dim))
        check_status(self._paged_attention_decode(
            code, out.data_ptr(), query.data_ptr(), query.stride(0), key_cache.data_ptr(),
            value_cache.data_ptr(), num_blocks, block_table.data_ptr(), block_table.shape[1],
            block_table.stride(0), seq_lens.data_ptr(), num_seqs, num_heads, num_kv_heads,
            head_dim, block_size, scale, sliding_window or 0, num_threads, ptrs, lens),
            "paged_attention_decode")
        return out

    # ---------------------------------------------------------------- quantized KV
    def write_kv_quant(self, fmt: str, key: torch.Tensor, value: torch.Tensor,
                       key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
        """Quantize ``key``/``value`` ``[T, Hkv, D]`` (float32/bfloat16, heads contiguous
        within a token) into the quantized caches ``[blocks, bs, Hkv, D + 2]`` (int8 for
        ``fmt="int8"``, uint8 for ``"fp8_e4m3"``; layout: ``cpu_kernels_kvq.c``) at
        ``slot_mapping`` ``[T]`` int64 (``-1`` skips).

        Raises:
            ValueError: an unknown format, a slot outside the cache, or mismatched layouts.
        """
        if fmt == "int8" and key_cache.shape[-1] == key.shape[-1]:  # per-channel keys
            from llmserve.kernels.cpu_kvc import write_kv_quant_kc

            return write_kv_quant_kc(self, key, value, key_cache, value_cache, slot_mapping)
        code, storage = KV_QUANT_FORMATS[fmt]
        num_tokens, num_kv_heads, head_dim = key.shape
        if key.stride()[1:] != (head_dim, 1) or value.stride()[1:] != (head_dim, 1) or \
                value.shape != key.shape or value_cache.shape != key_cache.shape or \
                key_cache.dtype != storage or value_cache.dtype != storage or \
                tuple(key_cache.shape[2:]) != (num_kv_heads, head_dim + 2) or \
                not (key_cache.is_contiguous() and value_cache.is_contiguous()) or \
                not (key_cache.is_cpu and value_cache.is_cpu) or \
                slot_mapping.dtype != torch.int64 or slot_mapping.numel() != num_tokens or \
                not slot_mapping.is_contiguous():
            raise ValueError(f"write_kv_quant: K/V {tuple(key.shape)} strides {key.stride()}, "
                             f"caches {tuple(key_cache.shape)} {key_cache.dtype}, slot_mapping "
                             f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
        dt = _code(key, value)
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        check_status(self._write_kv_quant(code, dt, key_cache.data_ptr(), value_cache.data_ptr(),
                                          num_slots, key.data_ptr(), key.stride(0),
                                          value.data_ptr(), value.stride(0),
                                          slot_mapping.data_ptr(), num_tokens, num_kv_heads,
                                          head_dim), "write_kv_quant")

    def paged_attention_decode_quant(self, fmt: str, query: torch.Tensor,
                                     key_cache: torch.Tensor, value_cache: torch.Tensor,
                                     block_table: torch.Tensor, seq_lens: torch.Tensor,
                                     scale: float, sliding_window: int | None = None,
                                     num_threads: int = 1,
                                     block_scores: BlockScoreArrays | None = None
                                     ) -> torch.Tensor:
        """:meth:`paged_attention_decode` over quantized caches ``[blocks, bs, Hkv, D + 2]``
        (``fmt`` ``"int8"`` or ``"fp8_e4m3"``): each position's rows are dequantized in the
        kernel's loop (codes times the row's fp16 scale), never a whole block.
        ``block_scores`` as there.

        Returns:
            ``[S, H, D]`` in the query dtype (float32 softmax and accumulation).

        Raises:
            ValueError: as :meth:`paged_attention_decode`, or an unknown format.
        """
        if fmt == "int8" and key_cache.shape[-1] == query.shape[-1]:  # per-channel keys
            from llmserve.kernels.cpu_kvc import paged_attention_decode_quant_kc

            return paged_attention_decode_quant_kc(self, query, key_cache, value_cache,
                                                   block_table, seq_lens, scale,
                                                   sliding_window, num_threads)
        code, storage = KV_QUANT_FORMATS[fmt]
        num_seqs, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        if query.stride(2) != 1 or query.stride(1) != head_dim or \
                key_cache.shape[3] != head_dim + 2 or value_cache.shape != key_cache.shape or \
                key_cache.dtype != storage or value_cache.dtype != storage or \
                not (key_cache.is_cpu and value_cache.is_cpu) or \
                not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError(f"paged_attention_decode_quant: query {tuple(query.shape)} strides "
                             f"{query.stride()}, caches {tuple(key_cache.shape)} "
                             f"{key_cache.dtype} (contiguous)")
        if block_table.dtype != torch.int64 or seq_lens.dtype != torch.int64 or \
                block_table.shape[0] != num_seqs or block_table.stride(1) != 1 or \
                seq_lens.shape != (num_seqs,) or not seq_lens.is_contiguous() or \
                not (block_table.is_cpu and seq_lens.is_cpu):
            raise ValueError("paged_attention_decode_quant: int64 CPU block_table [S, B] (rows "
                             "contiguous) and seq_lens [S] needed")
        dt = _code(query)
        ptrs, lens = (None, None) if block_scores is None else \
            block_scores.ptr_args(num_seqs, "paged_attention_decode_quant")
        out = query.new_empty((num_seqs, num_heads, head_dim))
        check_status(self._paged_attention_decode_quant(
            code, dt, out.data_ptr(), query.data_ptr(), query.stride(0), key_cache.data_ptr(),
            value_cache.data_ptr(), num_blocks, block_table.data_ptr(), block_table.shape[1],
            block_table.stride(0), seq_lens.data_ptr(), num_seqs, num_heads, num_kv_heads,
            head_dim, block_size, scale, sliding_window or 0, num_threads, ptrs, lens),
            "paged_attention_decode_quant")
        return out

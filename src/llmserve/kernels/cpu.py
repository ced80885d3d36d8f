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

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# quantized KV cache formats (cpu_kernels_kvq.c): name -> (code, cache storage dtype)
KV_QUANT_FORMATS = {"int8": (0, torch.int8), "fp8_e4m3": (1, torch.uint8)}
# GGUF types of gguf_matmul: name -> (ggml type id, weights per block, bytes per block)
GGUF_MATMUL_TYPES = {"Q5_0": (6, 32, 22), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144),
                     "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}
_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int

_SIGNATURES = {
    # dtype, out, x, x_stride, residual, residual_out, weight, num_tokens, hidden, eps
    "rms_norm": [_INT, _P, _P, _I64, _P, _P, _P, _I64, _I64, _F32],
    # dtype, x, num_tokens, num_heads, head_dim, token_stride, head_stride, cos, sin
    "rotary_emb": [_INT, _P, _I64, _I64, _I64, _I64, _I64, _P, _P],
    # dtype, key_cache, value_cache, num_slots, key, key_stride, value, value_stride,
    # slot_mapping, num_tokens, row
    "write_kv": [_INT, _P, _P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64],
    # dtype, out, x, num_tokens, d
    "silu_and_mul": [_INT, _P, _P, _I64, _I64],
    # dtype, out, x, x_stride, codes, scales, M, N, K, num_threads
    "q8_0_matmul": [_INT, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _INT],
    # qtype, dtype, out, out_stride, x, x_stride, blocks, M, N, K, num_threads
    "gguf_matmul": [_INT, _INT, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _INT],
    # qtype, dtype, out, out_stride, x, x_stride, blocks, M, N, K, num_threads
    "gguf_matmul_q8k": [_INT, _INT, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _INT],
    # dtype, x, x_stride, M, K, codes, scales
    "q8k_quantize": [_INT, _P, _I64, _I64, _I64, _P, _P],
    "gguf_q8k_available": [],
    # dtype, out, query, q_stride, key_cache, value_cache, num_blocks, block_table,
    # bt_width, bt_stride, seq_lens, num_seqs, num_heads, num_kv_heads, head_dim,
    # block_size, scale, window, num_threads, score_ptrs, score_lens
    "paged_attention_decode": [_INT, _P, _P, _I64, _P, _P, _I64, _P, _I64, _I64, _P, _I64,
                               _I64, _I64, _I64, _I64, _F32, _I64, _INT, _P, _P],
    # fmt, dtype, key_cache, value_cache, num_slots, key, key_stride, value, value_stride,
    # slot_mapping, num_tokens, num_kv_heads, head_dim
    "write_kv_quant": [_INT, _INT, _P, _P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64],
    # fmt, then the arguments of paged_attention_decode
    "paged_attention_decode_quant": [_INT, _INT, _P, _P, _I64, _P, _P, _I64, _P, _I64, _I64,
                                     _P, _I64, _I64, _I64, _I64, _I64, _F32, _I64, _INT, _P,
                                     _P],
    # per-channel int8 keys (cpu_kernels_kvc.c; wrappers in cpu_kvc.py): dtype, key_cache,
    # value_cache, num_blocks, block_size, key, key_stride, value, value_stride,
    # slot_mapping, num_tokens, num_kv_heads, head_dim
    "write_kv_quant_kc": [_INT, _P, _P, _I64, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64],
    # the arguments of paged_attention_decode
    "paged_attention_decode_quant_kc": [_INT, _P, _P, _I64, _P, _P, _I64, _P, _I64, _I64, _P,
                                        _I64, _I64, _I64, _I64, _I64, _F32, _I64, _INT],
    # dtype, out, query, q_stride, key, key_stride, value, value_stride, slot_mapping,
    # key_cache, value_cache, num_blocks, block_table, bt_width, bt_stride, seq_lens,
    # num_tokens, num_heads, num_kv_heads, head_dim, block_size, scale, window, num_threads
    "paged_prefill_quant_kc": [_INT, _P, _P, _I64, _P, _I64, _P, _I64, _P, _P, _P, _I64, _P,
                               _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F32, _I64, _INT],
}


def check_status(status: int, what: str) -> None:
    if status == -3:
        raise ValueError(f"{what}: a slot or block id is outside the KV cache")
    if status == -4:
        raise ValueError(f"{what}: a seq_len is < 1 or longer than its block table")
    if status == -6:
        raise ValueError(f"{what}: a block score array is shorter than its sequence's blocks")
    if status != 0:
        raise ValueError(f"{what}: invalid arguments (kernel status {status})")


def _code(x: torch.Tensor, *others: torch.Tensor) -> int:
    """The dtype code of ``x``; every tensor on the CPU with ``x``'s dtype (else ValueError)."""
    code = DTYPE_CODES.get(x.dtype)
    ok = code is not None and x.is_cpu
    dtype = x.dtype
    for t in others:  # (a plain loop: a generator here costs a microsecond)
        ok = ok and t.dtype == dtype and t.is_cpu
    if not ok:
        raise ValueError(f"CPU kernels need CPU float32 or bfloat16 tensors of one dtype, got "
                         f"{[(t.dtype, t.device.type) for t in (x, *others)]}")
    return code


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


class CpuKernels:
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

    def q8_0_matmul(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    num_threads: int = 1) -> torch.Tensor:
        """``x W^T`` for a GGUF Q8_0 weight ``W = d * q`` kept as its blocks.

        Args:
            x: ``[M, K]`` (rows may be strided), ``1 <= M <= 16``.
            codes: int8 ``[N, K]`` contiguous; scales: float32 ``[N, K / 32]`` contiguous.

        Returns:
            ``[M, N]`` in ``x``'s dtype; float32 products and sums (each ``q * x`` exact).

        Raises:
            ValueError: shapes, dtypes or M outside 1..16.
        """
        num_rows, k = x.shape
        n = codes.shape[0]
        if codes.dtype != torch.int8 or scales.dtype != torch.float32 or x.stride(1) != 1 or \
                codes.shape != (n, k) or scales.shape != (n, k // 32) or k % 32 or \
                not (codes.is_contiguous() and scales.is_contiguous()) or \
                not 1 <= num_rows <= 16 or not (codes.is_cpu and scales.is_cpu):
            raise ValueError(f"q8_0_matmul: x {tuple(x.shape)}, codes {tuple(codes.shape)} "
                             f"{codes.dtype}, scales {tuple(scales.shape)} {scales.dtype}")
        code = _code(x)
        out = x.new_empty((num_rows, n))
        check_status(self._q8_0_matmul(code, out.data_ptr(), x.data_ptr(), x.stride(0),
                                 codes.data_ptr(), scales.data_ptr(), num_rows, n, k,
                                 num_threads), "q8_0_matmul")
        return out

    def gguf_matmul(self, qtype: str, x: torch.Tensor, blocks: torch.Tensor,
                    num_threads: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T`` for a GGUF weight ``W [N, K]`` read straight from its blocks.

        Args:
            qtype: one of :data:`GGUF_MATMUL_TYPES` (``"Q4_K"``, ``"Q5_K"``, ``"Q6_K"``,
                ``"Q5_0"``, ``"Q8_0"``).
            x: ``[M, K]`` (rows may be strided), ``1 <= M <= 16``.
            blocks: uint8 ``[N, K / block_weights * block_bytes]`` contiguous (the file's
                bytes, row by row).
            out: optional ``[M, N]`` destination in ``x``'s dtype (rows may be strided,
                e.g. a column slice of a fused layer's output).

        Returns:
            ``[M, N]`` in ``x``'s dtype. Each weight is formed as ``q * s - o`` in float32,
            equal to ``gguf.quants`` bit for bit; products and sums in float32.

        Raises:
            ValueError: unknown type, shapes, dtypes or M outside 1..16.
        """
        num_rows, k = x.shape
        n = blocks.shape[0]
        layout = GGUF_MATMUL_TYPES.get(qtype)
        if layout is None or blocks.dtype != torch.uint8 or x.stride(1) != 1 or \
                k % layout[1] or blocks.shape != (n, k // layout[1] * layout[2]) or \
                not blocks.is_contiguous() or not 1 <= num_rows <= 16 or not blocks.is_cpu:
            raise ValueError(f"gguf_matmul: {qtype} x {tuple(x.shape)}, blocks "
                             f"{tuple(blocks.shape)} {blocks.dtype}")
        code = _code(x) if out is None else _code(x, out)
        if out is None:
            out = x.new_empty((num_rows, n))
        elif out.shape != (num_rows, n) or out.stride(1) != 1:
            raise ValueError(f"gguf_matmul: out {tuple(out.shape)} strides {out.stride()}, "
                             f"expected [{num_rows}, {n}] with contiguous rows")
        check_status(self._gguf_matmul(layout[0], code, out.data_ptr(), out.stride(0),
                                       x.data_ptr(), x.stride(0), blocks.data_ptr(), num_rows,
                                       n, k, num_threads), "gguf_matmul")
        return out

    @property
    def has_q8k_dot(self) -> bool:
        """True where :meth:`gguf_matmul_q8k` runs (built with AVX512-VNNI, CPU has it)."""
        return bool(self._gguf_q8k_available())

    def gguf_matmul_q8k(self, qtype: str, x: torch.Tensor, blocks: torch.Tensor,
                        num_threads: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T`` for a GGUF Q4_K / Q6_K weight with ``x`` quantized to int8 per row
        (Q8_K: one float32 scale per 256 values) and integer dot products (AVX512-VNNI),
        llama.cpp's ``ggml_vec_dot_q4_K_q8_K`` / ``q6_K_q8_K`` scheme (cpu_kernels_vnni.c).

        Args:
            qtype: ``"Q4_K"`` or ``"Q6_K"``.
            x: ``[M, K]`` (rows may be strided), ``1 <= M <= 16``, ``K % 256 == 0``.
            blocks: uint8 ``[N, K / 256 * block_bytes]`` contiguous (the file's bytes).
            out: optional ``[M, N]`` destination in ``x``'s dtype (rows may be strided).

        Returns:
            ``[M, N]`` in ``x``'s dtype: exact integer block sums times float32 scales,
            summed in float32 in a fixed order (a row's result never depends on the others).

        Raises:
            ValueError: another type, shapes, dtypes, M outside 1..16, or no AVX512-VNNI
                (check :attr:`has_q8k_dot`).
        """
        num_rows, k = x.shape
        n = blocks.shape[0]
        layout = GGUF_MATMUL_TYPES.get(qtype) if qtype in ("Q4_K", "Q6_K") else None
        if layout is None or blocks.dtype != torch.uint8 or x.stride(1) != 1 or \
                k % 256 or blocks.shape != (n, k // 256 * layout[2]) or \
                not blocks.is_contiguous() or not 1 <= num_rows <= 16 or not blocks.is_cpu:
            raise ValueError(f"gguf_matmul_q8k: {qtype} x {tuple(x.shape)}, blocks "
                             f"{tuple(blocks.shape)} {blocks.dtype}")
        code = _code(x) if out is None else _code(x, out)
        if out is None:
            out = x.new_empty((num_rows, n))
        elif out.shape != (num_rows, n) or out.stride(1) != 1:
            raise ValueError(f"gguf_matmul_q8k: out {tuple(out.shape)} strides {out.stride()}, "
                             f"expected [{num_rows}, {n}] with contiguous rows")
        status = self._gguf_matmul_q8k(layout[0], code, out.data_ptr(), out.stride(0),
                                       x.data_ptr(), x.stride(0), blocks.data_ptr(), num_rows,
                                       n, k, num_threads)
        if status == -5:
            raise ValueError("gguf_matmul_q8k: this CPU or build has no AVX512-VNNI")
        check_status(status, "gguf_matmul_q8k")
        return out

    def q8k_quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Q8_K activation quantization of :meth:`gguf_matmul_q8k`: ``x [M, K]`` ->
        int8 codes ``[M, K]`` and float32 scales ``[M, K / 256]`` (``x ~ codes * scale``).

        Raises:
            ValueError: ``K % 256 != 0`` or a non-contiguous last dimension.
        """
        num_rows, k = x.shape
        if k % 256 or x.stride(1) != 1 or num_rows < 1:
            raise ValueError(f"q8k_quantize: x {tuple(x.shape)} (K a multiple of 256)")
        codes = torch.empty((num_rows, k), dtype=torch.int8)
        scales = torch.empty((num_rows, k // 256), dtype=torch.float32)
        check_status(self._q8k_quantize(_code(x), x.data_ptr(), x.stride(0), num_rows, k,
                                        codes.data_ptr(), scales.data_ptr()), "q8k_quantize")
        return codes, scales

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

"""Typed wrappers over the C kernels of ``cpu_kernels.c`` (see the package docstring).

Each wrapper checks what the C code relies on (dtype, device, contiguous last
dimension, matching shapes) and raises ``ValueError`` otherwise; the layers call
:meth:`CpuKernels.supports` first and fall back to PyTorch for anything else
(CUDA tensors, float16).
"""

from __future__ import annotations

import ctypes

import torch

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
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
    # dtype, out, query, q_stride, key_cache, value_cache, num_blocks, block_table,
    # bt_stride, seq_lens, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
    # scale, window, num_threads
    "paged_attention_decode": [_INT, _P, _P, _I64, _P, _P, _I64, _P, _I64, _P, _I64, _I64,
                               _I64, _I64, _I64, _F32, _I64, _INT],
}


def _check(status: int, what: str) -> None:
    if status == -3:
        raise ValueError(f"{what}: a slot or block id is outside the KV cache")
    if status == -4:
        raise ValueError(f"{what}: a seq_len is < 1 or longer than its block table")
    if status != 0:
        raise ValueError(f"{what}: invalid arguments (kernel status {status})")


class CpuKernels:
    """The C kernels of one loaded library. All tensors: CPU, float32 or bfloat16."""

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
        return x.is_cpu and x.dtype in _DTYPE_CODES and x.stride(-1) == 1

    @staticmethod
    def _dtype(*tensors: torch.Tensor) -> int:
        dtype = tensors[0].dtype
        code = _DTYPE_CODES.get(dtype)
        for t in tensors:
            if t.dtype != dtype or not t.is_cpu or code is None:
                raise ValueError(f"CPU kernels need CPU float32 or bfloat16 tensors of one "
                                 f"dtype, got {[(u.dtype, u.device.type) for u in tensors]}")
        return code

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of ``x`` ``[T, H]`` (rows may be strided); with ``residual``
        ``[T, H]`` returns ``(norm(x + residual), x + residual)`` (new tensors)."""
        if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
            raise ValueError(f"rms_norm: x {tuple(x.shape)} with weight {tuple(weight.shape)}")
        tensors = (x, weight) if residual is None else (x, weight, residual)
        dtype = self._dtype(*tensors)
        weight = weight.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        res_in = res_out = None
        if residual is not None:
            if residual.shape != x.shape:
                raise ValueError(f"rms_norm: residual {tuple(residual.shape)} != x "
                                 f"{tuple(x.shape)}")
            res_in = residual.contiguous()
            res_out = torch.empty_like(out)
        _check(self._rms_norm(dtype, out.data_ptr(), x.data_ptr(), x.stride(0),
                              None if res_in is None else res_in.data_ptr(),
                              None if res_out is None else res_out.data_ptr(),
                              weight.data_ptr(), x.shape[0], x.shape[1], eps), "rms_norm")
        return out if residual is None else (out, res_out)

    def rotary_emb_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate ``x`` ``[T, heads, head_dim]`` in place (rotate_half layout) by
        ``cos``/``sin`` ``[T, head_dim / 2]`` (or ``[T, 1, head_dim / 2]``)."""
        if x.dim() != 3 or x.stride(2) != 1:
            raise ValueError(f"rotary_emb_: x must be [T, heads, head_dim] with a contiguous "
                             f"last dim, got {tuple(x.shape)} strides {x.stride()}")
        num_tokens, heads, head_dim = x.shape
        cos = cos.reshape(num_tokens, head_dim // 2).contiguous()
        sin = sin.reshape(num_tokens, head_dim // 2).contiguous()
        dtype = self._dtype(x, cos, sin)
        _check(self._rotary_emb(dtype, x.data_ptr(), num_tokens, heads, head_dim,
                                x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr()),
               "rotary_emb")

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[T, Hkv, D]`` (heads contiguous within a token) at
        ``slot_mapping`` ``[T]`` int64 (``-1`` skips) of caches ``[blocks, bs, Hkv, D]``.

        Raises:
            ValueError: a slot outside the cache, or mismatched layouts.
        """
        num_tokens = key.shape[0]
        row = key_cache.shape[-2] * key_cache.shape[-1]
        for t in (key, value):
            if t.shape[1:] != key_cache.shape[-2:] or t.stride(2) != 1 or \
                    t.stride(1) != key_cache.shape[-1]:
                raise ValueError(f"write_kv: K/V {tuple(t.shape)} strides {t.stride()} do not "
                                 f"match the cache {tuple(key_cache.shape)}")
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()) or \
                slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
            raise ValueError("write_kv: contiguous caches and an int64 slot_mapping [T] needed")
        dtype = self._dtype(key, value, key_cache, value_cache)
        slots = slot_mapping.contiguous()
        _check(self._write_kv(dtype, key_cache.data_ptr(), value_cache.data_ptr(),
                              key_cache.numel() // row, key.data_ptr(), key.stride(0),
                              value.data_ptr(), value.stride(0), slots.data_ptr(),
                              num_tokens, row), "write_kv")

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, 2 d]`` = ``[gate | up]`` -> ``silu(gate) * up`` ``[T, d]``."""
        if x.dim() != 2 or x.shape[1] % 2:
            raise ValueError(f"silu_and_mul: x must be [T, 2 * d], got {tuple(x.shape)}")
        dtype = self._dtype(x)
        x = x.contiguous()
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        _check(self._silu_and_mul(dtype, out.data_ptr(), x.data_ptr(), x.shape[0],
                                  x.shape[1] // 2), "silu_and_mul")
        return out

    def paged_attention_decode(self, query: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, block_table: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None,
                               num_threads: int = 1) -> torch.Tensor:
        """Attention of one query token per sequence over its paged context.

        Args:
            query: ``[S, H, D]``, heads contiguous within a token (rows may be strided).
            key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` contiguous.
            block_table: ``[S, max_blocks]`` int64; seq_lens: ``[S]`` int64, the
                context length including the query token (its K/V already written).
            scale: score scale (``head_dim ** -0.5``); sliding_window: keys within the
                last ``window`` positions only; num_threads: split over threads when large.

        Returns:
            ``[S, H, D]`` in the query dtype (float32 softmax and accumulation).

        Raises:
            ValueError: a block id outside the cache, a seq_len beyond its block table,
                or mismatched shapes.
        """
        num_seqs, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        if query.stride(2) != 1 or query.stride(1) != head_dim or \
                key_cache.shape[-1] != head_dim or value_cache.shape != key_cache.shape:
            raise ValueError(f"paged_attention_decode: query {tuple(query.shape)} strides "
                             f"{query.stride()} vs cache {tuple(key_cache.shape)}")
        if block_table.dtype != torch.int64 or seq_lens.dtype != torch.int64 or \
                block_table.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
            raise ValueError("paged_attention_decode: int64 block_table [S, B] and "
                             "seq_lens [S] needed")
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("paged_attention_decode: contiguous caches needed")
        dtype = self._dtype(query, key_cache, value_cache)
        block_table = block_table.contiguous()
        seq_lens = seq_lens.contiguous()
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype)
        _check(self._paged_attention_decode(
            dtype, out.data_ptr(), query.data_ptr(), query.stride(0), key_cache.data_ptr(),
            value_cache.data_ptr(), num_blocks, block_table.data_ptr(), block_table.shape[1],
            seq_lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
            scale, sliding_window or 0, num_threads), "paged_attention_decode")
        return out

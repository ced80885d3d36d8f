"""Quantized KV cache pages (``--kv-cache-dtype int8|fp8_e4m3``): layout and PyTorch reference.

A quantized layer cache keeps, per token and KV head, ``head_dim`` one-byte codes and
then that row's fp16 scale, so each block carries its own scales::

    key_cache: [num_blocks, block_size, num_kv_heads, head_dim + 2]   int8 (int8 codes)
                                                                      uint8 (fp8 e4m3 bits)
    one row:   | c_0 c_1 ... c_{D-1} | scale (fp16, 2 bytes, little endian) |

    int8:      s = fp16(absmax / 127),  c = clamp(round(x / s), -127, 127),  x' = c * s
    fp8_e4m3:  s = fp16(absmax / 448),  c = e4m3fn(clamp(x / s, -448, 448)),  x' = f32(c) * s

(per-token, per-head symmetric absmax scales, as LMDeploy's int8 KV and llama.cpp's
q8_0 blocks with one block per head row; fp8 as vLLM's e4m3 KV with a per-token-per-head
instead of a per-tensor scale). Swap, copy-on-write and the shared KV store move whole
blocks along dim 0, so they carry the scales with the codes unchanged.

The cache's torch dtype names its format (int8 -> int8, uint8 -> fp8_e4m3); the C
kernels (``kernels/cpu_kernels_kvq.c``) quantize on write and dequantize row by row
inside the attention loop. The functions here are the reference they are tested
against and the fallback where the kernels are unavailable.
"""

from __future__ import annotations

import torch

#: --kv-cache-dtype of a quantized format -> the cache tensor's dtype
QUANT_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.uint8}
_FORMAT_OF = {torch.int8: "int8", torch.uint8: "fp8_e4m3"}
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
SCALE_BYTES = 2  # one fp16 scale per (token, KV head)


def kv_cache_format(cache: torch.Tensor) -> str | None:
    """``"int8"`` / ``"fp8_e4m3"`` for a quantized cache, None for a float one."""
    return _FORMAT_OF.get(cache.dtype)


def head_dim_of(cache: torch.Tensor) -> int:
    """The head_dim of a layer cache (a quantized row has 2 scale bytes after it)."""
    return cache.shape[-1] - (SCALE_BYTES if cache.dtype in _FORMAT_OF else 0)


def kv_cache_shapes(kv_cache_dtype: str, model_dtype: torch.dtype, kv_key_quant: str,
                    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
                    ) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]:
    """(cache dtype, key cache shape, value cache shape) of one layer. ``kv_key_quant``
    ``"per-channel"`` (int8 only): keys in kv_quant_pc.py's block layout, two scale rows
    after each block's codes.

    Raises:
        ValueError: an unknown name, or per-channel keys with another dtype.
    """
    dtype, extra = kv_cache_storage(kv_cache_dtype, model_dtype)
    value = (num_blocks, block_size, num_kv_heads, head_dim + extra)
    if kv_key_quant == "per-token":
        return dtype, value, value
    if kv_key_quant != "per-channel" or kv_cache_dtype != "int8":
        raise ValueError(f"kv_key_quant must be per-token, or per-channel with "
                         f"kv_cache_dtype int8, got {kv_key_quant!r} with {kv_cache_dtype!r}")
    return dtype, (num_blocks, block_size + 2, num_kv_heads, head_dim), value


def kv_cache_storage(kv_cache_dtype: str, model_dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(cache tensor dtype, extra elements per head row) for a resolved KV cache dtype.

    Raises:
        ValueError: an unknown name.
    """
    if kv_cache_dtype in QUANT_STORAGE:
        return QUANT_STORAGE[kv_cache_dtype], SCALE_BYTES
    floats = {"auto": model_dtype, "bfloat16": torch.bfloat16, "float32": torch.float32,
              "float16": torch.float16}
    if kv_cache_dtype not in floats:
        raise ValueError(f"kv_cache_dtype must be one of auto, bfloat16, float32, int8, "
                         f"fp8_e4m3, got {kv_cache_dtype!r}")
    return floats[kv_cache_dtype], 0


def quantize_kv(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows ``x`` ``[..., head_dim]`` (any float dtype) -> quantized rows
    ``[..., head_dim + 2]`` in the storage dtype of ``fmt`` (module docstring)."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / QMAX[fmt]).clamp(max=65504.0)
    scale_h = scale.to(torch.float16)
    s = scale_h.float()
    safe = torch.where(s == 0, torch.ones_like(s), s)
    if fmt == "int8":
        codes = torch.round(xf / safe).clamp(-127, 127).to(torch.int8)
    else:
        codes = (xf / safe).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(s == 0, torch.zeros_like(codes), codes)
    scale_bytes = scale_h.contiguous().view(torch.uint8).view(QUANT_STORAGE[fmt])
    return torch.cat([codes, scale_bytes], -1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantized rows ``[..., head_dim + 2]`` -> ``[..., head_dim]`` values (float32 math:
    ``codes * scale``, then cast to ``dtype``). A float tensor is returned cast only."""
    fmt = kv_cache_format(rows)
    if fmt is None:
        return rows.to(dtype)
    codes = rows[..., :-SCALE_BYTES]
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()  # [..., 1]
    if fmt == "int8":
        values = codes.float()
    else:
        values = codes.contiguous().view(torch.float8_e4m3fn).float()
    return (values * scale).to(dtype)


def write_kv_quant(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize ``key``/``value`` ``[T, Hkv, D]`` into quantized caches at ``slot_mapping``
    (PyTorch; the C kernel ``write_kv_quant`` computes the same bytes)."""
    if key_cache.dtype == torch.int8 and key_cache.shape[-1] == key.shape[-1]:
        from llmserve.layers.attention.kv_quant_pc import write_kv_per_channel

        return write_kv_per_channel(key, value, key_cache, value_cache, slot_mapping)
    fmt = kv_cache_format(key_cache)
    num_kv_heads, row = key_cache.shape[-2:]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, quantize_kv(key, fmt))
    value_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping,
                                                         quantize_kv(value, fmt))

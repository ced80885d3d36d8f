"""The C library's ABI as ctypes sees it: dtype and format codes, every exported
function's argument types (``_SIGNATURES``), the status check and the dtype check the
wrappers share (``kernels/cpu.py``, ``cpu_gguf.py``, ``cpu_kvc.py``)."""

from __future__ import annotations

import ctypes

import torch

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# quantized KV cache formats (cpu_kernels_kvq.c): name -> (code, cache storage dtype)
KV_QUANT_FORMATS = {"int8": (0, torch.int8), "fp8_e4m3": (1, torch.uint8)}
# GGUF types of gguf_matmul: name -> (ggml type id, weights per block, bytes per block)
# bytes of one x16 tile (16 rows x one block: 256 weights, Q8_0 / Q5_0 32) of
# gguf_repack_x16 / gguf_matmul_x16
X16_TILE_BYTES = {"Q4_K": 2368, "Q6_K": 3360, "Q8_0": 544, "Q5_0": 352}
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
    # dtype, x, x_stride, M, K, codes, scales
    "q8k_quantize": [_INT, _P, _I64, _I64, _I64, _P, _P],
    "gguf_q8k_available": [],
    # qtype, blocks, N, K, tiles (cpu_kernels_x16.c)
    "gguf_repack_x16": [_INT, _P, _I64, _I64, _P],
    # qtype, dtype, out, out_stride, x, x_stride, tiles, M, N, K, num_threads
    "gguf_matmul_x16": [_INT, _INT, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _INT],
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

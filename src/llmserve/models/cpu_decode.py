"""The CPU decode fast path of the Llama-family decoder (pure decode steps).

A decode step at batch 1 does ~5 ms of matmuls (SmolLM2-135M, native 4-bit) and,
through the generic module code, ~2.3 ms of Python around them: module calls,
argument checks, views. This path runs each decoder layer as a fixed sequence of
raw C kernel calls (``llmserve.kernels``) and matmul closures, with every check
done once per step in :meth:`CpuDecodeStep.build`::

    per layer:  add+RMSNorm -> qkv matmul -> RoPE(q, k) in place -> write K/V to the
                cache -> paged decode attention -> o matmul -> add+RMSNorm ->
                gate_up matmul -> SwiGLU -> down matmul

Numerics are those of the generic path (the same kernels, the same order). It is
used when every scheduled sequence decodes one token, the kernels are available,
the activations are float32 or bfloat16 on the CPU and the attention backend is
``"cpu"``, and only for models made of plain Llama layers (``LlamaModel.use_cpu_decode_path``:
Llama, Mistral, Qwen2, Phi-3; QK-norm, sandwich-norm or MoE layers run their modules);
otherwise :class:`~llmserve.models.llama.LlamaModel` runs its modules. Each layer uses its
own sliding window (per-layer windows) and rotates its first ``rotary_dim`` dimensions.
Measured (docs/benchmarks.md): 2.3 -> 1.1 ms of non-matmul time per batch-1 step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmserve.kernels import get_cpu_kernels
from llmserve.kernels.cpu import DTYPE_CODES, KV_QUANT_FORMATS, CpuKernels, check_status
from llmserve.layers.attention.kv_quant import kv_cache_format

KVQ_INT8_KC = 2  # cpu_kernels_kvc.c: int8 pages, per-channel keys


@dataclass
class CpuDecodeStep:
    """What every layer of one pure decode step shares, checked once."""

    kernels: CpuKernels
    dtype_code: int
    num_tokens: int
    cos_ptr: int  # [T, head_dim / 2] contiguous
    sin_ptr: int
    slot_ptr: int  # [T] int64
    block_table: torch.Tensor  # [T, max_blocks] int64, rows contiguous
    seq_lens_ptr: int  # [T] int64
    window: int
    num_threads: int
    num_blocks: int  # KV cache blocks per layer
    block_size: int
    kv_format: int = -1  # quantized KV pages (layers/attention/kv_quant.py): format code
    # KV eviction by attention: the decode kernels' block score accumulators (kernels/cpu.py
    # BlockScoreArrays, kept alive here), or None; their (ptrs, lens) addresses
    block_scores: Any = None
    score_ptrs: int | None = None
    score_lens: int | None = None
    # (KVQ_INT8_KC: per-channel int8 keys, kv_quant_pc.py; block_size is the value cache's)

    @classmethod
    def build(cls, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              attn_metadata: Any) -> CpuDecodeStep | None:
        """The step's shared arguments, or None when the fast path does not apply."""
        kernels = get_cpu_kernels()
        md = attn_metadata
        if kernels is None or getattr(md, "num_prefills", 1) != 0 or \
                getattr(md, "decode_block_table", None) is None:
            return None
        common = md.step_common() if hasattr(md, "step_common") else md
        if getattr(common, "window_layout", None) is not None:  # two block tables
            return None
        scores = None
        if getattr(md, "block_scores", None) is not None:  # KV eviction: scored decodes
            scores = _decode_score_arrays(md)
            if scores is False:
                return None
        code = DTYPE_CODES.get(hidden.dtype)
        key_cache = kv_caches[0][0]
        if code is None or not hidden.is_cpu or not hidden.is_contiguous() or \
                cos.dtype != hidden.dtype or not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        num_tokens = hidden.shape[0]
        fmt = kv_cache_format(key_cache)
        value_cache = kv_caches[0][1]
        cache_dtype = hidden.dtype if fmt is None else key_cache.dtype
        for kc, vc in kv_caches:
            if kc.dtype != cache_dtype or vc.dtype != cache_dtype or not kc.is_cpu or \
                    not (kc.is_contiguous() and vc.is_contiguous()) or \
                    kc.shape != key_cache.shape or vc.shape != value_cache.shape:
                return None
        table, seq_lens, slots = md.decode_block_table, md.decode_seq_lens, md.slot_mapping
        kv_format = -1 if fmt is None else KV_QUANT_FORMATS[fmt][0]
        if key_cache.shape[1] != value_cache.shape[1]:  # per-channel int8 keys
            from llmserve.layers.attention.cpu_kc import needs_sequential

            if fmt != "int8" or needs_sequential(md, value_cache.shape[1]):
                return None  # two tokens write one block: token by token (cpu_kc.py)
            kv_format = KVQ_INT8_KC
        elif key_cache.shape != value_cache.shape:
            return None
        for t in (table, seq_lens, slots):
            if t.dtype != torch.int64 or not t.is_cpu or t.stride(-1) != 1:
                return None
        if table.shape[0] != num_tokens or seq_lens.shape != (num_tokens,) or \
                slots.shape != (num_tokens,) or not seq_lens.is_contiguous():
            return None
        ptrs, lens = (None, None) if scores is None else scores.ptr_args(num_tokens, "decode")
        return cls(kernels, code, num_tokens, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                   table, seq_lens.data_ptr(), md.sliding_window or 0,
                   torch.get_num_threads(), key_cache.shape[0], value_cache.shape[1],
                   kv_format, scores, ptrs, lens)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; residual None: ``(norm(x), x)``."""
        out, res_out = self.kernels.rms_norm_unchecked(self.dtype_code, x, weight, eps, residual)
        return out, x if res_out is None else res_out


def _decode_score_arrays(md: Any):
    """The decode kernels' block score accumulators of a scored step (None: no row is
    scored), or False where the C kernels cannot score it (the scored PyTorch path)."""
    from llmserve.layers.attention import scored

    if not scored.KERNEL_DECODE_SCORES or not hasattr(md, "decode_score_arrays"):
        return False
    try:
        return md.decode_score_arrays()
    except ValueError:  # accumulators the kernel cannot take (not float32 CPU)
        return False


def decode_layer(layer: Any, step: CpuDecodeStep, hidden: torch.Tensor,
                 residual: torch.Tensor | None,
                 kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``LlamaDecoderLayer`` on the fast path (see the module docstring)."""
    attn, mlp, k = layer.self_attn, layer.mlp, step.kernels
    code, num_tokens = step.dtype_code, step.num_tokens
    num_heads, num_kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    norm = layer.input_layernorm
    x, residual = step.rms_norm(hidden, norm.weight, norm.variance_epsilon, residual)
    qkv = attn.qkv_proj.matmul_fn()(x)  # [T, (H + 2 Hkv) * D]
    if not qkv.is_contiguous():
        qkv = qkv.contiguous()
    row, esize = qkv.shape[1], qkv.element_size()
    qkv_ptr = qkv.data_ptr()
    key_ptr = qkv_ptr + attn.q_size * esize
    value_ptr = key_ptr + attn.kv_size * esize
    key_cache, value_cache = kv_cache
    # the first rotary_dim dims of each query and key head (all of them unless partial)
    check_status(k._rotary_emb(code, qkv_ptr, num_tokens, num_heads + num_kv_heads,
                               attn.rotary_dim, row, head_dim, step.cos_ptr, step.sin_ptr),
                 "rotary_emb")
    out = torch.empty((num_tokens, attn.q_size), dtype=hidden.dtype)
    table = step.block_table
    window = attn.attn.sliding_window or step.window
    if step.kv_format == KVQ_INT8_KC:  # per-channel int8 keys (kv_quant_pc.py)
        check_status(k._write_kv_quant_kc(
            code, key_cache.data_ptr(), value_cache.data_ptr(), step.num_blocks,
            step.block_size, key_ptr, row, value_ptr, row, step.slot_ptr, num_tokens,
            num_kv_heads, head_dim), "write_kv_quant_kc")
        check_status(k._paged_attention_decode_quant_kc(
            code, out.data_ptr(), qkv_ptr, row, key_cache.data_ptr(), value_cache.data_ptr(),
            step.num_blocks, table.data_ptr(), table.shape[1], table.stride(0),
            step.seq_lens_ptr, num_tokens, num_heads, num_kv_heads, head_dim, step.block_size,
            attn.attn.scale, window, step.num_threads), "paged_attention_decode_quant_kc")
    elif step.kv_format >= 0:  # quantized pages: quantize on write, dequantize per row
        check_status(k._write_kv_quant(
            step.kv_format, code, key_cache.data_ptr(), value_cache.data_ptr(),
            step.num_blocks * step.block_size, key_ptr, row, value_ptr, row, step.slot_ptr,
            num_tokens, num_kv_heads, head_dim), "write_kv_quant")
        check_status(k._paged_attention_decode_quant(
            step.kv_format, code, out.data_ptr(), qkv_ptr, row, key_cache.data_ptr(),
            value_cache.data_ptr(), step.num_blocks, table.data_ptr(), table.shape[1],
            table.stride(0), step.seq_lens_ptr, num_tokens, num_heads, num_kv_heads, head_dim,
            step.block_size, attn.attn.scale, window, step.num_threads, step.score_ptrs,
            step.score_lens), "paged_attention_decode_quant")
    else:
        check_status(k._write_kv(code, key_cache.data_ptr(), value_cache.data_ptr(),
                                 step.num_blocks * step.block_size, key_ptr, row, value_ptr,
                                 row, step.slot_ptr, num_tokens, attn.kv_size), "write_kv")
        check_status(k._paged_attention_decode(
            code, out.data_ptr(), qkv_ptr, row, key_cache.data_ptr(), value_cache.data_ptr(),
            step.num_blocks, table.data_ptr(), table.shape[1], table.stride(0),
            step.seq_lens_ptr, num_tokens, num_heads, num_kv_heads, head_dim, step.block_size,
            attn.attn.scale, window, step.num_threads, step.score_ptrs, step.score_lens),
            "paged_attention_decode")
    hidden = attn.o_proj.matmul_fn()(out)
    norm = layer.post_attention_layernorm
    x, residual = step.rms_norm(hidden, norm.weight, norm.variance_epsilon, residual)
    gate_up = mlp.gate_up_proj.matmul_fn()(x)  # [T, 2 * intermediate]
    if not gate_up.is_contiguous():
        gate_up = gate_up.contiguous()
    act = torch.empty((num_tokens, gate_up.shape[1] // 2), dtype=hidden.dtype)
    check_status(k._silu_and_mul(code, act.data_ptr(), gate_up.data_ptr(), num_tokens,
                           act.shape[1]), "silu_and_mul")
    return mlp.down_proj.matmul_fn()(act), residual

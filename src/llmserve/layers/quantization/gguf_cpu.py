"""GGUF weights in the C kernels, and fused layers of mixed GGUF types.

Which kernel runs a GGUF tensor (``--quantization gguf-native`` / ``gguf-hybrid``)::

    Q4_K, Q6_K, Q8_0, Q5_0 with bfloat16 activations on an AVX512-VNNI CPU (the
    default there; LLMSERVE_Q8K_DOT=0 turns it off)
                              -> gguf_matmul_x16 (C, int8 activations, the blocks
                                 repacked 16 rows to a tile at load)
    a tied Q8_0 LM head       -> q8_0_matmul (bfloat16 activations, gguf_native.py)
    Q4_0, Q4_1, Q4_K          -> int4 kernel (int4pack: group-32 codes, exact mapping)
    Q4_K where z = -dmin m + 8 d sc is not exact in float32 -> gguf_matmul
    Q5_0, Q5_K, Q6_K, Q8_0    -> gguf_matmul (C, the file's own bytes; needs the C kernels)
    Q8_0 without C kernels    -> int4 kernel, input doubled (int4pack)

``gguf_matmul_x16`` is llama.cpp's CPU scheme (``ggml_vec_dot_q4_K_q8_K`` /
``q6_K_q8_K``; ``q8_0_q8_0`` / ``q5_0_q8_0``): each row of x quantized to int8 per 256
values (Q8_K; per 32 for Q8_0 / Q5_0 weights), integer dot products with the codes,
exact per block; plus a second pass for rows with
massive activations (a 256-value span whose max |x| exceeds 32x its mean |x|), which
llama.cpp does not have. Measured on Qwen2.5-Coder-1.5B Q4_K_M against the dequantized
float32 model (the 96 tokens of the real-model test, gguf-native, every row int8):
max |logit diff| 0.91, mean 0.056, perplexity -0.28%; the bfloat16-activation kernels
0.72 / 0.025 / -0.18%; Q8_K alone (and llama.cpp) 13.1 / 0.097 / +4.1%, all of it at
position 0, where a lone token's hidden state carries Qwen2's massive activations (a
256-value block's max up to 240x its mean). Batch-1 decode of that model: 1.6x the
bfloat16-activation kernels (benchmarks/gguf_q8k.py --model). Float32 activations
never use it.

A fused layer (q/k/v, gate/up) whose shards differ in kernel is split into
consecutive row parts, one weight per part, and their outputs are written side by
side (:class:`FusedNativeWeight`): a Q4_K_M ``qkv_proj`` with a Q6_K ``v_proj``
runs q and k in the int4 kernel and v in the C kernel. Without the C kernels, a
layer with a Q5_0 / Q5_K / Q6_K shard stays dense (dequantized at load).

Numerics of ``gguf_matmul``: each weight is formed in float32 as ``q * s - o`` (the
``gguf.quants`` formula, bit for bit), multiplied by the float32 activations with
float32 FMAs (16 lanes, then a sum), output rounded to the activation dtype.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from llmserve.kernels import get_cpu_kernels
from llmserve.layers.quantization.gguf_blocks import INT4_GGUF_TYPES, GGUFQuantizedTensor
from llmserve.layers.quantization.int4pack import Int4PackedWeight, pack_gguf_shards

logger = logging.getLogger(__name__)
C_KERNEL_TYPES = frozenset({"Q5_0", "Q5_K", "Q6_K", "Q8_0"})
C_FALLBACK_TYPES = frozenset({"Q4_K"})  # also in gguf_matmul, used when int4 is inexact
MAX_ROWS = 16  # gguf_matmul takes at most 16 rows of x a call
X16_TYPES = frozenset({"Q4_K", "Q6_K", "Q8_0", "Q5_0"})  # gguf_matmul_x16


def q8k_enabled(dtype: torch.dtype) -> bool:
    """True where Q4_K / Q6_K / Q8_0 / Q5_0 run in ``gguf_matmul_x16`` (int8
    activations): bfloat16 activations and C kernels with AVX512-VNNI, unless
    ``LLMSERVE_Q8K_DOT=0``."""
    if dtype != torch.bfloat16 or os.environ.get("LLMSERVE_Q8K_DOT", "1").strip().lower() in \
            ("0", "false", "no", "off"):
        return False
    kernels = get_cpu_kernels()
    return kernels is not None and kernels.has_q8k_dot


class GGUFBlockWeight:
    """One GGUF weight ``[N, K]``: its file bytes (uint8 ``[N, bytes per row]``) for the
    C kernel ``gguf_matmul``, or, when ``int8_activations`` (Q4_K / Q6_K / Q8_0 / Q5_0),
    those bytes repacked into x16 tiles (``[ceil(N / 16), K / weights a block * tile
    bytes]``) for ``gguf_matmul_x16``."""

    def __init__(self, qtype: str, blocks: torch.Tensor, in_features: int,
                 dtype: torch.dtype, int8_activations: bool = False) -> None:
        self.qtype, self.activation_dtype = qtype, dtype
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.int8_activations = int8_activations
        # int8 activations: the blocks repacked 16 rows to a tile (gguf_matmul_x16)
        self.blocks = get_cpu_kernels().gguf_repack_x16(qtype, blocks) if int8_activations \
            else blocks

    def nbytes(self) -> int:
        return self.blocks.numel()

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]`` (into ``out`` when given); M above 16 in chunks."""
        kernels = get_cpu_kernels()
        if self.int8_activations:
            n = self.out_features

            def kernel(qtype, x, tiles, threads, out):
                return kernels.gguf_matmul_x16(qtype, x, tiles, n, threads, out)
        else:
            kernel = kernels.gguf_matmul
        threads = torch.get_num_threads()
        if x.shape[0] <= MAX_ROWS:
            return kernel(self.qtype, x, self.blocks, threads, out)
        if out is None:
            out = x.new_empty((x.shape[0], self.out_features))
        for i in range(0, x.shape[0], MAX_ROWS):
            kernel(self.qtype, x[i:i + MAX_ROWS], self.blocks, threads, out[i:i + MAX_ROWS])
        return out


NativeWeight = Int4PackedWeight | GGUFBlockWeight


class FusedNativeWeight:
    """Consecutive row parts of one fused weight, each in its own kernel; ``matmul``
    writes each part's output columns into one ``[M, N]`` tensor."""

    def __init__(self, parts: list[NativeWeight]) -> None:
        self.parts = parts
        self.activation_dtype = parts[0].activation_dtype
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bounds = np.cumsum([0] + [p.out_features for p in parts]).tolist()

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0], self.out_features))
        for part, lo, hi in zip(self.parts, self.bounds, self.bounds[1:]):
            if isinstance(part, GGUFBlockWeight):
                part.matmul(x, out[:, lo:hi])
            else:
                out[:, lo:hi] = part.matmul(x)
        return out


def _kernel_of(qtype: str, c_kernels: bool, q8k: bool = False) -> str | None:
    if q8k and qtype in X16_TYPES:
        return "q8k"
    if c_kernels and qtype in C_KERNEL_TYPES:
        return "c"
    return "int4" if qtype in INT4_GGUF_TYPES else None


def native_weight_types(dtype: torch.dtype) -> frozenset[str]:
    """The GGUF types :func:`build_native_weight` runs natively for ``dtype`` here."""
    c_ok = get_cpu_kernels() is not None and dtype in (torch.bfloat16, torch.float32)
    return frozenset(INT4_GGUF_TYPES | (C_KERNEL_TYPES if c_ok else frozenset()))


def build_native_weight(shards: list[GGUFQuantizedTensor], dtype: torch.dtype,
                        ) -> Int4PackedWeight | GGUFBlockWeight | FusedNativeWeight | None:
    """The native weight of a (fused) layer from its shards, top to bottom; None when a
    shard has no native kernel here (the layer then stays dense).

    Raises:
        ValueError: shards of different input sizes (int4pack's checks).
    """
    c_ok = get_cpu_kernels() is not None and dtype in (torch.bfloat16, torch.float32)
    q8k = c_ok and q8k_enabled(dtype)
    kinds = [_kernel_of(t.qtype, c_ok, q8k) for t in shards]
    if None in kinds:
        return None
    parts: list[NativeWeight] = []
    for group, kind in _runs(shards, kinds):
        if kind == "int4":
            try:
                parts.append(pack_gguf_shards([t.unpack() for t in group], dtype))
                continue
            except ValueError as e:  # an inexact Q4_K zero point (never seen in real files)
                if "not exact" not in str(e) or not c_ok or \
                        any(t.qtype not in C_FALLBACK_TYPES | C_KERNEL_TYPES for t in group):
                    raise
                logger.info("%s; this layer runs in gguf_matmul instead", e)
            parts += [_block_weight(g, dtype) for g, _ in _runs(group, ["c"] * len(group))]
        else:
            parts.append(_block_weight(group, dtype, kind == "q8k"))
    return parts[0] if len(parts) == 1 else FusedNativeWeight(parts)


def _runs(shards: list[GGUFQuantizedTensor], kinds: list[str]):
    """Maximal runs of consecutive shards of one kernel (and, for C, one type)."""
    i = 0
    while i < len(shards):
        j = i
        while j < len(shards) and kinds[j] == kinds[i] and \
                (kinds[i] == "int4" or shards[j].qtype == shards[i].qtype):
            j += 1
        yield shards[i:j], kinds[i]
        i = j


def _block_weight(group: list[GGUFQuantizedTensor], dtype: torch.dtype,
                  int8_activations: bool = False) -> GGUFBlockWeight:
    blocks = np.concatenate([np.ascontiguousarray(t.blocks) for t in group])  # a copy
    return GGUFBlockWeight(group[0].qtype, torch.from_numpy(blocks), group[0].shape[1], dtype,
                           int8_activations)

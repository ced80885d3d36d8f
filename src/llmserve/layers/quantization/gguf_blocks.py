"""GGUF quantized blocks as they sit in the file, and their exact unpacking.

Block layouts (ggml ``ggml-common.h``; reference dequantization in ``gguf.quants``),
along the input dimension, little-endian; 32 weights per block::

    Q4_0  18 B: | d fp16 | 16 B nibbles |            w = d * (q - 8)     q in 0..15
    Q4_1  20 B: | d fp16 | m fp16 | 16 B nibbles |   w = d * q + m       q in 0..15
    Q8_0  34 B: | d fp16 | 32 x int8 q |              w = d * q           q in -128..127
    Q5_0  22 B: | d fp16 | qh u32 | 16 B nibbles |   w = d * (q - 16)    q = nib | bit << 4

    nibbles: byte j (0..15) holds q[j] in its low 4 bits and q[j + 16] in its high 4 bits

K-quants, 256 weights per super-block::

    Q4_K 144 B: | d fp16 | dmin fp16 | scales 12 B | qs 128 B |
        eight groups of 32: w = (d sc_j) q - (dmin m_j), 6-bit sc_j, m_j packed in
        the 12 bytes; group j reads qs[32 (j // 2) + l], low nibbles for even j
    Q5_K 176 B: | d | dmin | scales 12 B | qh 32 B | qs 128 B |  as Q4_K, plus bit j of qh[l]
    Q6_K 210 B: | ql 128 B | qh 64 B | scales 16 x int8 | d fp16 |
        sixteen groups of 16: w = (d sc_g) (q - 32), q = 4 bits of ql | 2 bits of qh << 4

Every product of an fp16 scale and these small integers is exact in float32, so
the float32 formulas above are what ``gguf.quants`` computes, bit for bit.
Q4_0 / Q4_1 / Q8_0 / Q4_K unpack to group-32 codes for the int4 kernel (Q4_K as
Q4_1 with ``d = d sc_j``, ``m = -dmin m_j``); the others run in the C kernel
``gguf_matmul`` straight from their bytes.

A weight ``[rows, cols]`` is stored row by row, ``cols / 32`` blocks per row, so a
row permutation (llama.cpp's Q/K head permutation) permutes whole byte rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from llmserve.layers.quantization.base import QuantizationConfig, QuantizedTensor

QK = 32  # weights per block for Q4_0, Q4_1, Q8_0, Q5_0; per scale group for Q4_K
# type -> (weights per block, bytes per block)
BLOCK_LAYOUT = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q5_0": (32, 22),
                "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
BLOCK_BYTES = {t: b for t, (_, b) in BLOCK_LAYOUT.items()}
NATIVE_GGUF_TYPES = frozenset(BLOCK_LAYOUT)
INT4_GGUF_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K"})  # types with unpack()


@dataclass
class UnpackedBlocks:
    """Exact integer codes and float32 block parameters of a GGUF weight ``[rows, cols]``.

    ``codes``: uint8 ``[rows, cols]`` in 0..15 (Q4_0, Q4_1, Q4_K) or int8 in -128..127 (Q8_0);
    ``d``: float32 ``[rows, cols / 32]`` (the fp16 scale, widened exactly; Q4_K: d sc_j);
    ``m``: float32 ``[rows, cols / 32]`` (Q4_1's fp16 minimum; Q4_K: -dmin m_j) or None.
    """

    qtype: str
    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray | None

    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, cols]`` by the GGUF formula (equal to ``gguf.quants`` bit for bit)."""
        rows, cols = self.codes.shape
        q = self.codes.reshape(rows, cols // QK, QK).astype(np.float32)
        d = self.d[..., None]
        if self.qtype == "Q4_0":
            w = d * (q - np.float32(8))
        elif self.qtype in ("Q4_1", "Q4_K"):
            w = d * q + self.m[..., None]
        else:
            w = q * d
        return w.reshape(rows, cols)


@dataclass
class GGUFQuantizedTensor(QuantizedTensor):
    """One GGUF tensor's raw blocks: ``blocks`` uint8 ``[rows, cols / block * block_bytes]``.

    ``shape`` is ``(rows, cols)`` in Hugging Face order (``[out_features, in_features]``).
    Q/K rows are already un-permuted by the loader.
    """

    qtype: str
    shape: tuple[int, int]
    blocks: np.ndarray
    config: QuantizationConfig

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_LAYOUT:
            raise ValueError(f"GGUF type {self.qtype!r} has no native kernel; "
                             f"supported: {sorted(BLOCK_LAYOUT)}")
        rows, cols = self.shape
        qb, bb = BLOCK_LAYOUT[self.qtype]
        if cols % qb or self.blocks.shape != (rows, cols // qb * bb):
            raise ValueError(f"{self.qtype} blocks of shape {self.blocks.shape} do not hold a "
                             f"[{rows}, {cols}] weight")

    def dequantize(self) -> torch.Tensor:
        """float32 ``[rows, cols]`` through ``gguf.quants.dequantize`` (llama.cpp's formulas)."""
        w = dequantize(np.ascontiguousarray(self.blocks), GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.array(w, dtype=np.float32).reshape(self.shape))

    def unpack(self) -> UnpackedBlocks:
        """Split the blocks into group-32 integer codes and float32 ``d`` (and ``m``), exactly.

        Raises:
            ValueError: a type outside :data:`INT4_GGUF_TYPES`.
        """
        if self.qtype not in INT4_GGUF_TYPES:
            raise ValueError(f"{self.qtype} blocks do not unpack to group-32 codes; "
                             f"unpackable: {sorted(INT4_GGUF_TYPES)}")
        rows, cols = self.shape
        if self.qtype == "Q4_K":
            return _unpack_q4_k(np.ascontiguousarray(self.blocks), rows, cols)
        b = np.ascontiguousarray(self.blocks).reshape(rows, cols // QK, BLOCK_BYTES[self.qtype])
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if self.qtype == "Q8_0":
            return UnpackedBlocks(self.qtype, b[..., 2:].copy().view(np.int8).reshape(rows, cols),
                                  d, None)
        m = None
        start = 2
        if self.qtype == "Q4_1":
            m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            start = 4
        nib = b[..., start:start + QK // 2]
        codes = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(rows, cols)
        return UnpackedBlocks(self.qtype, codes, d, m)


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K 12-byte ``scales [..., 12]`` -> 6-bit ``(sc, m)``, each ``[..., 8]``
    (``get_scale_k4`` of ggml-quants.c)::

        j < 4:  sc = s[j] & 63,                            m = s[j + 4] & 63
        j >= 4: sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4,  m = (s[j + 4] >> 4) | (s[j] >> 6) << 4
    """
    s = scales.astype(np.uint8)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, m


def _unpack_q4_k(blocks: np.ndarray, rows: int, cols: int) -> UnpackedBlocks:
    b = blocks.reshape(rows, cols // 256, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    sc, m = k_scale_min(b[..., 4:16])
    scale = (d[..., None] * sc.astype(np.float32)).reshape(rows, cols // QK)  # exact
    minimum = -(dmin[..., None] * m.astype(np.float32)).reshape(rows, cols // QK)  # exact
    qs = b[..., 16:].reshape(rows, cols // 256, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols)
    return UnpackedBlocks("Q4_K", codes, scale, minimum)


def gguf_type_name(ggml_type: int) -> str:
    """ggml type id -> name (``"Q4_1"``); ``"type_<id>"`` for an unknown id."""
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type_{ggml_type}"

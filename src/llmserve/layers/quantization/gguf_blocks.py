"""GGUF quantized blocks as they sit in the file, and their exact unpacking.

Block layouts (ggml ``ggml-common.h``; reference dequantization in ``gguf.quants``),
32 weights along the input dimension per block, little-endian::

    Q4_0  18 B: | d fp16 | 16 B nibbles |            w = d * (q - 8)     q in 0..15
    Q4_1  20 B: | d fp16 | m fp16 | 16 B nibbles |   w = d * q + m       q in 0..15
    Q8_0  34 B: | d fp16 | 32 x int8 q |              w = d * q           q in -128..127

    nibbles: byte j (0..15) holds q[j] in its low 4 bits and q[j + 16] in its high 4 bits

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

QK = 32  # weights per block for Q4_0, Q4_1, Q8_0
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
NATIVE_GGUF_TYPES = frozenset(BLOCK_BYTES)


@dataclass
class UnpackedBlocks:
    """Exact integer codes and float32 block parameters of a GGUF weight ``[rows, cols]``.

    ``codes``: uint8 ``[rows, cols]`` in 0..15 (Q4_0, Q4_1) or int8 in -128..127 (Q8_0);
    ``d``: float32 ``[rows, cols / 32]`` (the fp16 scale, widened exactly);
    ``m``: float32 ``[rows, cols / 32]`` (Q4_1's fp16 minimum) or None.
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
        elif self.qtype == "Q4_1":
            w = d * q + self.m[..., None]
        else:
            w = q * d
        return w.reshape(rows, cols)


@dataclass
class GGUFQuantizedTensor(QuantizedTensor):
    """One GGUF tensor's raw blocks: ``blocks`` uint8 ``[rows, cols / 32 * block_bytes]``.

    ``shape`` is ``(rows, cols)`` in Hugging Face order (``[out_features, in_features]``).
    Q/K rows are already un-permuted by the loader.
    """

    qtype: str
    shape: tuple[int, int]
    blocks: np.ndarray
    config: QuantizationConfig

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"GGUF type {self.qtype!r} has no native kernel; "
                             f"supported: {sorted(BLOCK_BYTES)}")
        rows, cols = self.shape
        if cols % QK or self.blocks.shape != (rows, cols // QK * BLOCK_BYTES[self.qtype]):
            raise ValueError(f"{self.qtype} blocks of shape {self.blocks.shape} do not hold a "
                             f"[{rows}, {cols}] weight")

    def dequantize(self) -> torch.Tensor:
        """float32 ``[rows, cols]`` through ``gguf.quants.dequantize`` (llama.cpp's formulas)."""
        w = dequantize(np.ascontiguousarray(self.blocks), GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.array(w, dtype=np.float32).reshape(self.shape))

    def unpack(self) -> UnpackedBlocks:
        """Split the blocks into integer codes and float32 ``d`` (and ``m``), exactly."""
        rows, cols = self.shape
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


def gguf_type_name(ggml_type: int) -> str:
    """ggml type id -> name (``"Q4_1"``); ``"type_<id>"`` for an unknown id."""
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type_{ggml_type}"

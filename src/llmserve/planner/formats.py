"""Storage sizes: KV cache dtypes and weight formats (pure Python).

Bits per weight of the GGUF types come from ggml's block layouts (the GGUF
spec, ``ggml/src/ggml-common.h`` in llama.cpp, mirrored by
``gguf.constants.GGML_QUANT_SIZES``): a block of ``B`` weights takes ``T`` bytes,
scales included, so a weight costs ``8 * T / B`` bits. Example: Q4_0 packs 32
weights as 16 bytes of nibbles plus one fp16 scale = 18 bytes -> 4.5 bits.

Group-quantized integer formats (AWQ, GPTQ) store ``bits`` per weight plus,
per group of ``group_size`` weights, one fp16 scale and (asymmetric) one
packed zero point of ``bits`` bits: int4 with group 128 costs
``4 + (16 + 4) / 128 = 4.156`` bits per weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: bytes of one element of a KV cache dtype (vLLM's ``--kv-cache-dtype`` names and aliases)
KV_CACHE_DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2,
    "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1,
}

#: extra bytes per (token, KV head) row of llmserve's quantized KV pages: one fp16 scale
#: (``--kv-cache-dtype int8|fp8_e4m3``, layers/attention/kv_quant.py). ``fp8`` keeps
#: vLLM's meaning here (per-tensor scale: no per-row bytes).
KV_CACHE_ROW_SCALE_BYTES: dict[str, int] = {"int8": 2, "fp8_e4m3": 2}


def kv_row_scale_bytes(kv_cache_dtype: str) -> int:
    """Scale bytes per token per KV head for ``kv_cache_dtype`` (0 for float dtypes)."""
    return KV_CACHE_ROW_SCALE_BYTES.get(str(kv_cache_dtype).lower(), 0)


#: GGUF tensor types: (weights per block, bytes per block). Source: ggml-common.h.
GGUF_BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q8_0": (32, 34), "Q8_1": (32, 40),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
    "Q6_K": (256, 210), "Q8_K": (256, 292),
    "IQ1_S": (256, 50), "IQ1_M": (256, 56), "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74),
    "IQ2_S": (256, 82), "IQ3_XXS": (256, 98), "IQ3_S": (256, 110), "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136), "TQ1_0": (256, 54), "TQ2_0": (256, 66), "MXFP4": (32, 17),
}

_PLAIN_BITS = {"fp32": 32, "float32": 32, "bf16": 16, "bfloat16": 16, "fp16": 16,
               "float16": 16, "half": 16, "fp8": 8, "fp8_e4m3": 8, "fp8_e5m2": 8}
_CANONICAL = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
              "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: str = "bfloat16") -> int:
    """Bytes per element of the KV cache for ``kv_cache_dtype``.

    ``"auto"`` means the model's dtype (``model_dtype``), as in vLLM.

    Raises:
        ValueError: for an unknown dtype, listing the allowed ones.
    """
    name = str(kv_cache_dtype).lower()
    if name == "auto":
        name = str(model_dtype).lower().removeprefix("torch.")
    if name not in KV_CACHE_DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; use auto or one of "
                         f"{', '.join(sorted(KV_CACHE_DTYPE_BYTES))}")
    return KV_CACHE_DTYPE_BYTES[name]


@dataclass(frozen=True)
class WeightFormat:
    """How one weight of a linear layer is stored.

    ``bits``: storage bits per weight (for GGUF types, scales included).
    ``group_size``: weights sharing one scale (0: no per-group scale).
    ``scale_bits`` / ``zero_bits``: per-group scale and zero point sizes.
    ``quantize_embeddings``: whether the embedding and lm_head matrices use the
    format too (plain dtypes and GGUF: yes; AWQ/GPTQ/fp8 checkpoints keep them
    in 16 bits, as vLLM loads them).
    """

    name: str
    bits: float
    group_size: int = 0
    scale_bits: int = 0
    zero_bits: int = 0
    quantize_embeddings: bool = True

    @property
    def bits_per_weight(self) -> float:
        """``bits + (scale_bits + zero_bits) / group_size`` (just ``bits`` without groups)."""
        if self.group_size:
            return self.bits + (self.scale_bits + self.zero_bits) / self.group_size
        return float(self.bits)

    @property
    def embedding_bits(self) -> float:
        """Bits per weight of the embedding / lm_head matrices."""
        return self.bits_per_weight if self.quantize_embeddings else 16.0

    def bytes_for(self, num_params: int, embedding: bool = False) -> int:
        """Bytes to store ``num_params`` weights: ``ceil(num_params * bits / 8)``."""
        bits = self.embedding_bits if embedding else self.bits_per_weight
        if bits == int(bits):
            return -(-num_params * int(bits) // 8)
        return math.ceil(num_params * bits / 8)

    def describe(self) -> str:
        """The bits-per-weight formula as text, e.g. ``4 + (16 + 4) / 128 = 4.156 bits``."""
        if self.group_size:
            zero = f" + {self.zero_bits}" if self.zero_bits else ""
            return (f"{self.bits:g} + ({self.scale_bits}{zero}) / {self.group_size} "
                    f"= {self.bits_per_weight:.4g} bits")
        return f"{self.bits_per_weight:.6g} bits"


def parse_weight_format(spec: str, model_dtype: str = "bfloat16") -> WeightFormat:
    """Parse a weight-format name.

    Accepted (case-insensitive):

    - ``auto``: ``model_dtype``;
    - ``fp32``, ``bf16``, ``fp16`` (and ``float32``/``bfloat16``/``float16``);
    - ``fp8`` (``fp8_e4m3``, ``fp8_e5m2``): 8 bits, per-tensor scales ignored;
    - ``int8``: 8 bits, per-channel scales ignored (< 0.01 bit per weight);
    - ``int4``, ``int4-g64``, ``int4-g128-sym``, ``int8-g128``: ``bits`` plus
      a 16-bit scale and (unless ``-sym``) a ``bits``-bit zero point per group
      (default group 128; ``-g0`` means per channel); ``awq`` / ``gptq`` mean
      ``int4-g128``;
    - a GGUF type: ``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q4_K``, ``Q5_K``, ``Q6_K``,
      ``F16``, ``IQ4_XS``, ... (see :data:`GGUF_BLOCK_SIZES`).

    Raises:
        ValueError: for an unknown name, listing the accepted ones.
    """
    raw = str(spec).strip()
    name = raw.lower()
    if name == "auto":
        name = str(model_dtype).lower().removeprefix("torch.")
    if name in _PLAIN_BITS:
        canon = _CANONICAL.get(name, name)
        quant_emb = canon != "fp8"
        return WeightFormat(canon, _PLAIN_BITS[name], quantize_embeddings=quant_emb)
    if name in ("awq", "gptq"):
        name = "int4-g128"
    if name.startswith(("int4", "int8")):
        return _parse_int_format(name, raw)
    gguf_name = raw.upper()
    if gguf_name in GGUF_BLOCK_SIZES:
        block, size = GGUF_BLOCK_SIZES[gguf_name]
        return WeightFormat(gguf_name, 8 * size / block)
    raise ValueError(
        f"unknown weight format {spec!r}; use auto, fp32, bf16, fp16, fp8, int8, int4, "
        f"int4-g<group>[-sym], awq, gptq, or a GGUF type ({', '.join(GGUF_BLOCK_SIZES)})")


def _parse_int_format(name: str, raw: str) -> WeightFormat:
    bits = int(name[3])
    parts = name.split("-")[1:]
    if name in ("int8",):
        return WeightFormat("int8", 8, quantize_embeddings=False)
    group, sym = 128, False
    for part in parts:
        if part == "sym":
            sym = True
        elif part.startswith("g") and part[1:].isdigit():
            group = int(part[1:])
        else:
            raise ValueError(f"bad weight format {raw!r}: expected int{bits}[-g<group>][-sym], "
                             f"e.g. int4-g128")
    if group == 0:
        return WeightFormat(f"int{bits}-g0", bits, quantize_embeddings=False)
    label = f"int{bits}-g{group}" + ("-sym" if sym else "")
    return WeightFormat(label, bits, group, 16, 0 if sym else bits, quantize_embeddings=False)


def gguf_type_bits(type_name: str) -> float:
    """Bits per weight of a GGUF tensor type (``8 * bytes_per_block / weights_per_block``).

    Raises:
        ValueError: for an unknown type.
    """
    key = type_name.upper()
    if key not in GGUF_BLOCK_SIZES:
        raise ValueError(f"unknown GGUF type {type_name!r}")
    block, size = GGUF_BLOCK_SIZES[key]
    return 8 * size / block

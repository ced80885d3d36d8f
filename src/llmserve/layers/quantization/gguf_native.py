"""Native GGUF weights: the int4 CPU kernel (Q4_0 / Q4_1 / Q4_K) and the C kernel
``gguf_matmul`` (Q5_0 / Q5_K / Q6_K / Q8_0) instead of dense matmuls.

Registered as ``gguf-native`` (packed weights only, the least memory) and
``gguf-hybrid`` (packed weights for steps of at most ``dense_threshold`` tokens,
plus a dense bfloat16 copy for larger steps, where a dense GEMM is faster: the
int4 kernel re-dequantizes every weight once per 4 rows of ``x``). Numerics and
the kernels' contracts: :mod:`llmserve.layers.quantization.int4pack` and
:mod:`llmserve.layers.quantization.gguf_cpu` (which type runs where).

Loading: each ``Linear`` switches to :class:`GGUFNativeLinearMethod` on its first
raw shard, collects its shards, and packs once every row is loaded. A fused
layer with shards of different kernels (a Q6_K ``v_proj`` next to Q4_K ``q_proj``)
runs each part in its own kernel; one with a dense (float) shard stays dense. A tied embedding (``lm_head`` = ``embed_tokens``) keeps its dense
table for the lookup, and :meth:`GGUFNativeConfig.process_model` gives the LM
head matmul the packed weight (the largest matmul of small models: 49152 x 576
for SmolLM2-135M).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels import get_cpu_kernels
from llmserve.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizedTensor,
    UnquantizedLinearMethod,
)
from llmserve.layers.quantization.gguf_blocks import GGUFQuantizedTensor
from llmserve.layers.quantization.gguf_cpu import (
    FusedNativeWeight,
    GGUFBlockWeight,
    build_native_weight,
    native_weight_types,
)
from llmserve.layers.quantization.int4pack import Int4PackedWeight

logger = logging.getLogger(__name__)

# Steps with more tokens than this use the dense copy in gguf-hybrid (measured on an
# AVX-512 Zen 4, 2 threads: int4 is 2.5-3x faster at 1 token, even at ~8, 2x slower at 64).
DEFAULT_DENSE_THRESHOLD = 8


class GGUFNativeConfig(QuantizationConfig):
    """Run GGUF Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_K / Q6_K / Q8_0 tensors natively.

    Args:
        dtype: activation dtype; ``torch.bfloat16`` (the vectorized kernel) or
            ``torch.float32`` (scalar kernel: exact, slow; for checks).
        dense_threshold: ``None`` = packed weights only; an int = also keep a dense copy
            in ``dtype`` and use it for steps of more tokens than this.

    Raises:
        ValueError: an unsupported dtype or a negative threshold.
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16,
                 dense_threshold: int | None = None) -> None:
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"native GGUF weights run bfloat16 (or float32) activations, "
                             f"got {dtype}")
        if dense_threshold is not None and dense_threshold < 0:
            raise ValueError(f"dense_threshold must be >= 0, got {dense_threshold}")
        self.dtype = dtype
        self.gguf_raw_types = native_weight_types(dtype)  # the rest arrives dequantized
        self.dense_threshold = dense_threshold
        self.name = "gguf-native" if dense_threshold is None else "gguf-hybrid"

    def get_linear_method(self, layer: nn.Module) -> LinearMethodBase:
        return GGUFNativeLinearMethod(self, layer)

    def process_model(self, model: nn.Module) -> None:
        """Give a tied embedding's LM-head matmul the packed weight; drop raw sources."""
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        for module in model.modules():
            if not isinstance(module, nn.Embedding):
                continue
            src = getattr(module.weight, "quantized_source", None)
            if not isinstance(src, GGUFQuantizedTensor):
                continue
            del module.weight.quantized_source
            if tied:
                packed = _q8_0_weight(src, self.dtype) or build_native_weight([src], self.dtype)
                if packed is None:
                    continue
                module.weight = nn.Parameter(
                    NativeLMHeadWeight(module.weight.data, packed, self.dense_threshold),
                    requires_grad=False)
                logger.info("tied LM head runs %s natively (%.1f MiB packed)", src.qtype,
                            packed.nbytes() / 2**20)


class GGUFNativeLinearMethod(LinearMethodBase):
    """Packed int4 weight (see module doc); dense copy in ``layer.weight`` for gguf-hybrid.

    Until every row is loaded, ``apply`` raises ``RuntimeError``. In gguf-native mode
    ``layer.weight`` becomes a ``meta`` tensor (shape and dtype kept, no memory).
    """

    def __init__(self, config: GGUFNativeConfig, layer: nn.Module) -> None:
        self.config = config
        self.packed: Int4PackedWeight | GGUFBlockWeight | FusedNativeWeight | None = None
        self.pending: list[tuple[int, GGUFQuantizedTensor]] = []
        # rows loaded densely before this method took over (a mixed fused layer)
        self.dense_rows: list[tuple[int, int]] = list(layer.loaded_weight_rows)

    def load_weight(self, layer: nn.Module, loaded: torch.Tensor | QuantizedTensor,
                    row_offset: int) -> None:
        if isinstance(loaded, GGUFQuantizedTensor):
            self.pending.append((row_offset, loaded))
        else:
            UnquantizedLinearMethod().load_weight(layer, loaded, row_offset)
            self.dense_rows.append((row_offset, loaded.shape[0]))
        loaded_rows = sum(t.shape[0] for _, t in self.pending) + sum(n for _, n in self.dense_rows)
        if loaded_rows == layer.output_size:
            self._finish(layer)

    def _finish(self, layer: nn.Module) -> None:
        shards = sorted(self.pending, key=lambda p: p[0])
        self.pending = []
        packed = None if self.dense_rows else \
            build_native_weight([t for _, t in shards], self.config.dtype)
        if packed is None:  # a float shard, or a type without a kernel: the layer stays dense
            for offset, t in shards:
                UnquantizedLinearMethod().load_weight(layer, t, offset)
            layer.quant_method = UnquantizedLinearMethod()
            logger.debug("layer with non-native shards stays dense")
            return
        self.packed = packed
        if self.config.dense_threshold is not None:
            for offset, t in shards:
                UnquantizedLinearMethod().load_weight(layer, t, offset)
        else:
            layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=layer.weight.dtype,
                                                    device="meta"), requires_grad=False)

    def make_matmul(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.packed is None:
            return super().make_matmul(layer)
        packed, bias = self.packed.matmul, layer.bias
        threshold, weight = self.config.dense_threshold, layer.weight
        if threshold is None and bias is None:
            return packed

        def matmul(x: torch.Tensor) -> torch.Tensor:
            if threshold is not None and x.shape[0] > threshold:
                return F.linear(x, weight, bias)
            y = packed(x)
            return y if bias is None else y.add_(bias)
        return matmul

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        threshold = self.config.dense_threshold
        if threshold is not None and x.shape[0] > threshold:
            return F.linear(x, layer.weight, bias)
        if self.packed is None:
            raise RuntimeError("GGUF native layer used before all of its weight rows were loaded")
        y = self.packed.matmul(x)
        return y if bias is None else y.add_(bias)


class Q8_0Weight:
    """A GGUF Q8_0 weight kept as int8 codes ``[N, K]`` and float32 scales ``[N, K / 32]``,
    multiplied by the C kernel ``q8_0_matmul`` (exact scales, 1.06 bytes a weight; the
    int4 kernel would need the input doubled and bf16-rounded scales, 1.25 bytes)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        self.codes, self.scales, self.activation_dtype = codes, scales, dtype
        self.out_features, self.in_features = codes.shape

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]``; M above 16 in chunks of 16."""
        kernels = get_cpu_kernels()
        threads = torch.get_num_threads()
        if x.shape[0] <= 16:
            return kernels.q8_0_matmul(x, self.codes, self.scales, threads)
        return torch.cat([kernels.q8_0_matmul(c, self.codes, self.scales, threads)
                          for c in x.split(16)])


def _q8_0_weight(src: GGUFQuantizedTensor, dtype: torch.dtype) -> Q8_0Weight | None:
    """The Q8_0 kernel's form of ``src``, or None (another type, or no C kernels)."""
    kernels = get_cpu_kernels()
    if src.qtype != "Q8_0" or kernels is None or dtype not in (torch.bfloat16, torch.float32):
        return None
    u = src.unpack()
    return Q8_0Weight(torch.from_numpy(u.codes.astype(np.int8, copy=False)).contiguous(),
                      torch.from_numpy(u.d.astype(np.float32, copy=False)).contiguous(), dtype)


class NativeLMHeadWeight(torch.Tensor):
    """A dense embedding table that runs ``F.linear(x, table)`` (the tied LM head) natively.

    The tensor is the dense ``[vocab, hidden]`` table (embedding lookups read it);
    ``F.linear(x [N, hidden], self)`` with ``N <= dense_threshold`` (or any N when it is
    None) runs the packed int4 kernel instead. Every other op sees a plain tensor.
    """

    packed: Int4PackedWeight | Q8_0Weight | GGUFBlockWeight | FusedNativeWeight
    dense_threshold: int | None

    @staticmethod
    def __new__(cls, dense: torch.Tensor,
                packed: Int4PackedWeight | Q8_0Weight | GGUFBlockWeight | FusedNativeWeight,
                dense_threshold: int | None) -> NativeLMHeadWeight:
        t = torch.Tensor._make_subclass(cls, dense, False)
        t.packed = packed
        t.dense_threshold = dense_threshold
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], cls):
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if bias is None and x.dim() == 2 and x.dtype == w.packed.activation_dtype \
                    and (w.dense_threshold is None or x.shape[0] <= w.dense_threshold):
                with torch._C.DisableTorchFunctionSubclass():
                    return w.packed.matmul(x)
        if func is torch.Tensor.detach:  # nn.Parameter(...) keeps the subclass
            with torch._C.DisableTorchFunctionSubclass():
                return NativeLMHeadWeight(func(*args, **kwargs), args[0].packed,
                                          args[0].dense_threshold)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

"""Native GGUF weights: the int4 CPU kernel (Q4_0 / Q4_1 / Q4_K) and the C kernel
``gguf_matmul`` (Q5_0 / Q5_K / Q6_K / Q8_0) instead of dense matmuls.

Registered as ``gguf-native`` (packed weights only, the least memory),
``gguf-hybrid`` (packed weights for decode rows, plus a dense bfloat16 copy for
prompt rows, where a dense GEMM is faster: the int4 kernel re-dequantizes every
weight once per 4 rows of ``x``) and ``gguf-hybrid-int8`` (the prompt-row copy as
W8A8 int8 codes: :mod:`llmserve.layers.quantization.int8_prefill`). Numerics and the kernels' contracts:
:mod:`llmserve.layers.quantization.int4pack` and
:mod:`llmserve.layers.quantization.gguf_cpu` (which type runs where).

Batch invariance (issue 20): a row's result never depends on the other rows of
the call, so a token's numerics never depend on which requests share its step::

    decode rows  (CPU decode path, Linear.matmul_fn)  -> packed kernel, any M
    prompt rows  (module path, Linear.forward)        -> gguf-native: packed kernel
                                                         gguf-hybrid: dense copy
    LM head      (F.linear on NativeLMHeadWeight)     -> packed kernel, any M
    untied LM head of GGUF blocks (gguf_matmul[_x16]) -> packed kernel, any M,
                                                         also in gguf-hybrid (no dense copy)

Measured on this engine's CPU (torch 2.13, 2 threads, bf16): the int4, Q8_0 and
``gguf_matmul`` kernels compute each row on its own (the same bits for every M);
oneDNN's bf16 GEMM does for every M >= 2 but its M = 1 path (a GEMV) sums in
another order, so a one-row call runs as two rows. The old rule (packed for steps
of <= 8 tokens, dense above) made a decode's numerics depend on how many tokens
shared its step.

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
from llmserve.layers.quantization.dense_prefill import (
    PrepackedDenseWeight,
    can_prepack,
    dense_linear,
)
from llmserve.layers.quantization.gguf_blocks import GGUFQuantizedTensor
from llmserve.layers.quantization.gguf_cpu import (
    FusedNativeWeight,
    GGUFBlockWeight,
    build_native_weight,
    native_weight_types,
)
from llmserve.layers.quantization.int4pack import Int4PackedWeight
from llmserve.layers.quantization.int8_prefill import Int8PrefillWeight

logger = logging.getLogger(__name__)



class GGUFNativeConfig(QuantizationConfig):
    """Run GGUF Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_K / Q6_K / Q8_0 tensors natively.

    Args:
        dtype: activation dtype; ``torch.bfloat16`` (the vectorized kernel) or
            ``torch.float32`` (scalar kernel: exact, slow; for checks).
        dense_prefill: False = packed weights only (``gguf-native``); True = also keep
            a second copy for prompt rows (``gguf-hybrid``; module doc).
        prefill_weights: that copy (``dense_prefill`` only): ``"int8"`` = W8A8 int8
            codes (:mod:`~llmserve.layers.quantization.int8_prefill`; the LM head keeps
            a dense copy), ``"dense"`` = every weight dense in ``dtype``.

    Raises:
        ValueError: an unsupported dtype or ``prefill_weights``.
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16, dense_prefill: bool = False,
                 prefill_weights: str = "dense") -> None:
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"native GGUF weights run bfloat16 (or float32) activations, "
                             f"got {dtype}")
        if prefill_weights not in ("int8", "dense"):
            raise ValueError(f"prefill_weights must be 'int8' or 'dense', got {prefill_weights!r}")
        self.dtype = dtype
        self.dense_prefill = dense_prefill
        # gguf-hybrid's prompt-row weights: W8A8 int8 (int8_prefill.py) or a dense copy
        self.int8_prefill = dense_prefill and prefill_weights == "int8"
        self.gguf_raw_types = native_weight_types(dtype)  # the rest arrives dequantized
        self.name = ("gguf-hybrid-int8" if self.int8_prefill else "gguf-hybrid") \
            if dense_prefill else "gguf-native"

    def get_linear_method(self, layer: nn.Module) -> LinearMethodBase:
        return GGUFNativeLinearMethod(self, layer)

    def process_model(self, model: nn.Module) -> None:
        """Give a tied embedding's LM-head matmul the packed weight; drop raw sources.

        gguf-hybrid: an untied LM head kept as GGUF blocks (``gguf_matmul`` or
        ``gguf_matmul_x16``) runs them for every row and drops its dense copy: 151936 x
        1536 bf16 is 445 MiB read each decode step (76 ms CPU on one thread here), the
        Q6_K blocks 182 MiB (2 threads, out of cache: 14.4 ms in gguf_matmul, 8.6 ms in
        gguf_matmul_x16).
        """
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, GGUFNativeLinearMethod) and method.sources is not None:
                if module is getattr(model, "lm_head", None):
                    method.make_dense(module)
                method.sources = None
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if self.dense_prefill and isinstance(method, GGUFNativeLinearMethod) and \
                _all_block_weights(method.packed):
            method.packed_all_rows = True
            head.weight = nn.Parameter(torch.empty(head.weight.shape, dtype=head.weight.dtype,
                                                   device="meta"), requires_grad=False)
            head.__dict__.pop("_matmul_fn", None)
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
                    NativeLMHeadWeight(module.weight.data, packed),
                    requires_grad=False)
                logger.info("tied LM head runs %s natively (%.1f MiB packed)", src.qtype,
                            packed.nbytes() / 2**20)

    def fix_layouts(self, model: nn.Module) -> None:
        """gguf-hybrid: prepack the dense prompt-row copies (:func:`_prepack_prompt_rows`)."""
        if self.dense_prefill and not self.int8_prefill:
            _prepack_prompt_rows(model)


def _prepack_prompt_rows(model: nn.Module) -> None:
    """gguf-hybrid: each layer's dense prompt-row copy -> oneDNN's blocked layout, once
    (:mod:`~llmserve.layers.quantization.dense_prefill`); the plain copy is dropped
    (``layer.weight`` becomes ``meta``: shape and dtype kept, no memory)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, GGUFNativeLinearMethod) or method.packed_all_rows or \
                method.prefill is not None or not can_prepack(module.weight):
            continue  # can_prepack: a CPU weight (not meta), bf16, oneDNN
        method.prefill = PrepackedDenseWeight(module.weight.data)
        module.weight = nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype,
                                                 device="meta"), requires_grad=False)


class GGUFNativeLinearMethod(LinearMethodBase):
    """Packed int4 weight (see module doc); dense copy in ``layer.weight`` for gguf-hybrid.

    ``make_matmul`` (the closure the CPU decode path runs on decode rows) always runs
    the packed kernel; ``apply`` (the module path: prompt rows, and decodes where the
    decode path does not apply) runs the dense copy in gguf-hybrid, the packed kernel
    in gguf-native. Neither choice depends on the number of rows.

    Until every row is loaded, the packed path raises ``RuntimeError``. In gguf-native
    mode ``layer.weight`` becomes a ``meta`` tensor (shape and dtype kept, no memory).
    """

    def __init__(self, config: GGUFNativeConfig, layer: nn.Module) -> None:
        self.config = config
        self.packed: Int4PackedWeight | GGUFBlockWeight | FusedNativeWeight | None = None
        self.packed_all_rows = False  # gguf-hybrid untied LM head of blocks (process_model)
        self.int8: Int8PrefillWeight | None = None  # gguf-hybrid's prompt rows (int8 mode)
        self.prefill: PrepackedDenseWeight | None = None  # or them prepacked (process_model)
        self.sources: list[tuple[int, GGUFQuantizedTensor]] | None = None  # until process_model
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
        if self.config.int8_prefill:  # rows in order, all of them GGUF shards
            self.int8 = Int8PrefillWeight.from_rows([t.dequantize() for _, t in shards],
                                                    rotate=True)
            self.sources = shards
        if self.config.dense_prefill and not self.config.int8_prefill:
            for offset, t in shards:
                UnquantizedLinearMethod().load_weight(layer, t, offset)
        else:
            layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=layer.weight.dtype,
                                                    device="meta"), requires_grad=False)

    def make_dense(self, layer: nn.Module) -> None:
        """Replace the int8 prompt-row copy by a dense one in ``dtype`` (the LM head)."""
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=self.config.dtype),
                                    requires_grad=False)
        for offset, t in self.sources:
            UnquantizedLinearMethod().load_weight(layer, t, offset)
        self.int8 = None
        layer.__dict__.pop("_matmul_fn", None)

    def make_matmul(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.packed is None:
            return super().make_matmul(layer)
        packed, bias = self.packed.matmul, layer.bias
        if bias is None:
            return packed

        def matmul(x: torch.Tensor) -> torch.Tensor:
            return packed(x).add_(bias)
        return matmul

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8.matmul(x, bias)
        if self.config.dense_prefill and not self.packed_all_rows:
            return dense_linear(x, layer.weight if self.prefill is None else self.prefill, bias)
        if self.packed is None:
            raise RuntimeError("GGUF native layer used before all of its weight rows were loaded")
        y = self.packed.matmul(x)
        return y if bias is None else y.add_(bias)


def _all_block_weights(packed) -> bool:
    """True for a packed weight whose every part is GGUF blocks in a C kernel (each row
    computed on its own: any M gives a row the same bits)."""
    parts = packed.parts if isinstance(packed, FusedNativeWeight) else [packed]
    return all(isinstance(p, GGUFBlockWeight) for p in parts)


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
    ``F.linear(x [N, hidden], self)`` runs the packed kernel for every N (one kernel
    for all rows: batch-invariant logits). Every other op sees a plain tensor.
    """

    packed: Int4PackedWeight | Q8_0Weight | GGUFBlockWeight | FusedNativeWeight

    @staticmethod
    def __new__(cls, dense: torch.Tensor,
                packed: Int4PackedWeight | Q8_0Weight | GGUFBlockWeight | FusedNativeWeight,
                ) -> NativeLMHeadWeight:
        t = torch.Tensor._make_subclass(cls, dense, False)
        t.packed = packed
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], cls):
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if bias is None and x.dim() == 2 and x.dtype == w.packed.activation_dtype:
                with torch._C.DisableTorchFunctionSubclass():
                    return w.packed.matmul(x)
        if func is torch.Tensor.detach:  # nn.Parameter(...) keeps the subclass
            with torch._C.DisableTorchFunctionSubclass():
                return NativeLMHeadWeight(func(*args, **kwargs), args[0].packed)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

"""Group-quantized integer weights (GPTQ, AWQ, compressed-tensors W4A16) on the int4 kernel.

Every 4-bit safetensors format here stores, per output row ``n`` and input group ``g``,
unsigned codes ``q`` in ``0 .. 2**bits - 1``, a scale ``s`` and an integer zero point
``z`` (in code units), with one formula::

    w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]        g(k) = g_idx[k]  (default k // group)

The formats differ only in how ``q`` / ``z`` / ``s`` are packed into int32 words (see
``gptq.py``, ``awq.py``, ``compressed_tensors.py``); each reader unpacks to a
:class:`GroupQuantizedTensor` and this module repacks it for PyTorch's int4 CPU
kernel (contract in :mod:`~llmserve.layers.quantization.int4pack`); 8-bit layers go to
the Q8_0 C kernel instead (``int8_group.py``)::

    kernel:  w = (q - 8) * s' + z'      so  s' = s,  z' = (8 - z) * s

``(8 - z) * s`` and ``(q - 8) * s`` are exact in float32 for fp16 / bf16 scales
(a 5-bit integer times an 11-bit mantissa), so with float32 activations the
kernel's weight equals the formula above bit for bit. With bfloat16 activations
``s'`` and ``z'`` are rounded to bfloat16, as for GGUF Q4_1 (int4pack.py).

Act-order (GPTQ ``desc_act``, ``g_idx`` not ``k // group``): the input columns are
permuted so that every group is contiguous (``perm = argsort(g_idx)``, stable) and
the activations are permuted the same way at run time, ``x[:, perm]`` (as vLLM's
exllama / Marlin ``g_idx`` sort). Layers the kernels cannot run (2 bits, a group
the kernel lacks, fused shards with different ``g_idx``) stay dense, dequantized
to the model dtype, with one log line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmserve.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizedTensor,
    UnquantizedLinearMethod,
)
from llmserve.layers.quantization.int4pack import N_ALIGN, Int4PackedWeight

logger = logging.getLogger(__name__)

KERNEL_GROUPS = (256, 128, 64, 32)  # the int4 kernel's group sizes, largest first
KERNEL_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


@dataclass
class GroupQuantizedTensor(QuantizedTensor):
    """One linear weight ``[N, K]`` as unsigned integer codes with group scales and zeros.

    ``codes`` uint8 ``[N, K]`` in ``0 .. 2**bits - 1``; ``scales`` float32 ``[N, G]``
    (the stored fp16 / bf16 / fp32 scale, widened exactly); ``zeros`` float32 ``[N, G]``
    (integers in code units); ``g_idx`` int64 ``[K]`` (group of each input column) or
    None for ``k // group_size``; ``source`` names the checkpoint tensor (errors, logs).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    bits: int
    config: QuantizationConfig
    g_idx: torch.Tensor | None = None
    source: str = ""

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        self.shape = (n, k)
        groups = self.scales.shape[1] if self.scales.dim() == 2 else -1
        where = f"{self.source}: " if self.source else ""
        if self.scales.shape != self.zeros.shape or self.scales.shape[0] != n:
            raise ValueError(f"{where}scales {tuple(self.scales.shape)} and zeros "
                             f"{tuple(self.zeros.shape)} do not fit a [{n}, {k}] weight")
        if self.g_idx is None:
            if self.group_size <= 0 or k % self.group_size or groups != k // self.group_size:
                raise ValueError(f"{where}{groups} scale groups do not fit {k} input "
                                 f"columns with group_size {self.group_size}")
        elif self.g_idx.shape != (k,) or int(self.g_idx.min()) < 0 or \
                int(self.g_idx.max()) >= groups:
            raise ValueError(f"{where}g_idx must be [{k}] with values in 0..{groups - 1}")

    def group_of_column(self) -> torch.Tensor:
        """int64 ``[K]``: the scale group of each input column."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.shape[1]) // self.group_size

    def dequantize(self) -> torch.Tensor:
        g = self.group_of_column()
        return (self.codes.float() - self.zeros[:, g]) * self.scales[:, g]


def trivial_g_idx(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether ``g_idx`` is the default ``k // group_size`` (no act-order)."""
    return group_size > 0 and torch.equal(g_idx.long(),
                                          torch.arange(g_idx.numel()) // group_size)


def contiguous_groups(t: GroupQuantizedTensor) -> tuple[torch.Tensor | None, int] | None:
    """``(perm, size)``: ``perm`` (int64 ``[K]`` or None) sorts the input columns into
    contiguous groups of ``size`` columns each; None when the groups differ in size."""
    k = t.shape[1]
    perm, size = None, t.group_size
    if t.g_idx is not None:
        counts = torch.bincount(t.g_idx, minlength=t.scales.shape[1])
        if counts.min() != counts.max():
            return None
        size = int(counts[0])
        if not torch.equal(t.g_idx, torch.arange(k) // size):
            perm = torch.argsort(t.g_idx, stable=True)
    return perm, size


def kernel_layout(t: GroupQuantizedTensor) -> tuple[torch.Tensor | None, int] | None:
    """``(perm, kernel_group)`` to run ``t`` on the int4 kernel, or None when it cannot:
    ``perm`` as :func:`contiguous_groups`; ``kernel_group`` the largest kernel group
    dividing the group size."""
    layout = contiguous_groups(t) if t.bits == 4 else None
    if layout is None:
        return None
    perm, size = layout
    k = t.shape[1]
    group = next((g for g in KERNEL_GROUPS if size % g == 0 and k % g == 0), None)
    return None if group is None else (perm, group)


def _same_perm(perms: list[torch.Tensor | None]) -> bool:
    return all((p is None) == (perms[0] is None) and
               (p is None or torch.equal(p, perms[0])) for p in perms)


def pack_int4_groups(shards: list[GroupQuantizedTensor], perm: torch.Tensor | None,
                     group: int, dtype: torch.dtype) -> Int4PackedWeight:
    """Stack row shards (top to bottom) into one :class:`Int4PackedWeight`.

    Args:
        shards: 4-bit tensors with the same K and column grouping (``kernel_layout``).
        perm: input column order (``x[:, perm]`` at run time) or None.
        group: kernel group size (32, 64, 128 or 256) dividing every shard's groups.
        dtype: activation dtype (bfloat16 fast; float32 exact; float16 scalar).

    Raises:
        ValueError: mismatched input sizes or an unsupported group / dtype.
    """
    k = shards[0].shape[1]
    if group not in KERNEL_GROUPS or k % group or any(t.shape[1] != k for t in shards):
        raise ValueError(f"int4 kernel needs one input size divisible by group {group}")
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"int4 kernel runs {KERNEL_DTYPES} activations, got {dtype}")
    codes, scales, zeros = [], [], []
    for t in shards:
        g = t.group_of_column()
        if perm is not None:
            g = g[perm]
        first = g[::group]  # [K / group]: the (single) source group of each kernel group
        c = t.codes if perm is None else t.codes[:, perm]
        codes.append(c.to(torch.int32))
        scales.append(t.scales[:, first])
        zeros.append(t.zeros[:, first])
    q = torch.cat(codes)
    s = torch.cat(scales)
    z = (8.0 - torch.cat(zeros)) * s
    n = q.shape[0]
    pad = -n % N_ALIGN
    if pad:
        q = torch.cat([q, torch.full((pad, k), 8, dtype=torch.int32)])
        s = torch.cat([s, s.new_zeros(pad, s.shape[1])])
        z = torch.cat([z, z.new_zeros(pad, z.shape[1])])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    sz = torch.stack([s, z], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return Int4GroupWeight(packed, sz, False, k, n, group, perm)


@dataclass
class Int4GroupWeight(Int4PackedWeight):
    """:class:`Int4PackedWeight` with any kernel group and an optional input permutation."""

    group: int = 32
    perm: torch.Tensor | None = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` -> ``x W^T`` ``[M, N]``."""
        x = x.index_select(1, self.perm) if self.perm is not None else x.contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group,
                                                       self.scales_and_zeros)
        return y if self.out_features % N_ALIGN == 0 else y[:, :self.out_features]


class CheckpointLinearMethod(LinearMethodBase):
    """Collects a (fused) layer's quantized shards; packs them once every row is loaded.

    Subclasses implement :meth:`pack` (return a kernel object with ``matmul`` and
    ``activation_dtype``, or None to stay dense). Until every row is loaded ``apply``
    raises ``RuntimeError``. A packed layer's ``layer.weight`` becomes a ``meta``
    tensor (shape and dtype kept, no memory).
    """

    def __init__(self, config: QuantizationConfig, layer: nn.Module) -> None:
        self.config = config
        self.kernel = None
        self.pending: list[tuple[int, QuantizedTensor]] = []
        self.dense_rows: list[tuple[int, int]] = list(layer.loaded_weight_rows)

    def pack(self, shards: list[QuantizedTensor], dtype: torch.dtype) -> Any:
        """The kernel object for the row-ordered ``shards``, or None (stay dense)."""
        raise NotImplementedError

    def load_weight(self, layer: nn.Module, loaded: torch.Tensor | QuantizedTensor,
                    row_offset: int) -> None:
        if isinstance(loaded, QuantizedTensor):
            self.pending.append((row_offset, loaded))
        else:
            UnquantizedLinearMethod().load_weight(layer, loaded, row_offset)
            self.dense_rows.append((row_offset, loaded.shape[0]))
        rows = sum(t.shape[0] for _, t in self.pending) + sum(n for _, n in self.dense_rows)
        if rows == layer.output_size:
            self._finish(layer)

    def _finish(self, layer: nn.Module) -> None:
        shards = sorted(self.pending, key=lambda p: p[0])
        self.pending = []
        kernel = None if self.dense_rows else self.pack([t for _, t in shards],
                                                         layer.weight.dtype)
        if kernel is None:
            for offset, t in shards:
                UnquantizedLinearMethod().load_weight(layer, t, offset)
            layer.quant_method = UnquantizedLinearMethod()
            logger.info("%s: stays dense (dequantized to %s)",
                        getattr(shards[0][1], "source", "a layer"), layer.weight.dtype)
            return
        self.kernel = kernel
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=layer.weight.dtype,
                                                device="meta"), requires_grad=False)

    def make_matmul(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.kernel is None:
            return super().make_matmul(layer)
        matmul, bias = self.kernel.matmul, layer.bias
        if bias is None:
            return matmul
        return lambda x: matmul(x).add_(bias)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError("quantized layer used before all of its weight rows were loaded")
        y = self.kernel.matmul(x)
        return y if bias is None else y.add_(bias)


class Int4GroupLinearMethod(CheckpointLinearMethod):
    """Group-quantized shards -> :class:`Int4GroupWeight` (4-bit) or
    :class:`~llmserve.layers.quantization.int8_group.Int8GroupWeight` (8-bit); dense
    when neither kernel can run them. Fused shards with different act-order stay dense
    (one ``x`` permutation only)."""

    def pack(self, shards: list[QuantizedTensor], dtype: torch.dtype) -> Any:
        if dtype not in KERNEL_DTYPES or \
                not all(isinstance(t, GroupQuantizedTensor) for t in shards):
            return None
        if all(t.bits == 8 for t in shards):
            from llmserve.layers.quantization.int8_group import pack_int8_groups

            layouts = [contiguous_groups(t) for t in shards]
            if any(lay is None for lay in layouts) or not _same_perm(
                    [lay[0] for lay in layouts]) or len({lay[1] for lay in layouts}) != 1:
                return None
            return pack_int8_groups(shards, layouts[0][0], layouts[0][1], dtype)
        layouts = [kernel_layout(t) for t in shards]
        if any(lay is None for lay in layouts) or not _same_perm([lay[0] for lay in layouts]):
            return None
        group = min(lay[1] for lay in layouts)
        return pack_int4_groups(shards, layouts[0][0], group, dtype)


class CheckpointQuantizationConfig(QuantizationConfig):
    """A safetensors checkpoint's own quantization (``quantization_config`` in config.json).

    Subclasses parse their ``quantization_config`` in ``__init__`` (``ValueError`` naming
    ``source`` and the field for anything unsupported) and implement
    :meth:`module_suffixes` / :meth:`read_module`, used by the safetensors loader.
    """

    def __init__(self, source: str) -> None:
        self.source = source

    def module_suffixes(self) -> tuple[str, ...]:
        """Tensor name suffixes (after ``<module>.``) that mark a quantized module."""
        raise NotImplementedError

    def marker_suffixes(self) -> tuple[str, ...]:
        """Suffixes whose presence makes ``<module>`` a quantized module."""
        return ("qweight",)

    def read_module(self, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantizedTensor:
        """``tensors``: suffix -> tensor for module ``prefix``; returns its weight.

        Raises:
            ValueError: a missing or malformed tensor (named).
        """
        raise NotImplementedError

    def get_linear_method(self, layer: nn.Module) -> LinearMethodBase:
        return Int4GroupLinearMethod(self, layer)

    def process_model(self, model: nn.Module) -> None:
        """A quantized LM head: its weight runs ``F.linear`` through the packed kernel."""
        from llmserve.layers.quantization.gguf_native import NativeLMHeadWeight

        lm_head = getattr(model, "lm_head", None)
        method = getattr(lm_head, "quant_method", None)
        if isinstance(method, CheckpointLinearMethod) and method.kernel is not None:
            lm_head.weight = nn.Parameter(
                NativeLMHeadWeight(lm_head.weight.data, method.kernel),
                requires_grad=False)


def require(tensors: dict[str, torch.Tensor], prefix: str, name: str,
            dtypes: tuple[torch.dtype, ...], ndim: int | None = None) -> torch.Tensor:
    """``tensors[name]`` checked for presence, dtype and rank.

    Raises:
        ValueError: naming ``prefix.name`` and what is wrong.
    """
    t = tensors.get(name)
    if t is None:
        raise ValueError(f"quantized module {prefix!r} has no tensor {prefix}.{name}")
    if t.dtype not in dtypes:
        raise ValueError(f"{prefix}.{name} has dtype {t.dtype}; expected one of "
                         f"{[str(d) for d in dtypes]}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{prefix}.{name} has shape {tuple(t.shape)}; expected {ndim} dims")
    return t


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split each int32 word into ``32 / bits`` unsigned fields, least significant first.

    ``packed`` ``[R, C]`` -> uint8 (int32 for bits > 8) with ``dim`` grown ``32 / bits``
    times: field ``i`` of word ``j`` becomes element ``j * (32 / bits) + i`` along ``dim``.
    (GPTQ / AWQ / compressed-tensors 2-, 4- and 8-bit packing never straddles a word.)
    """
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32).unsqueeze(-1) if dim == 1 else \
        packed.to(torch.int32).t().unsqueeze(-1)
    fields = (words >> shifts) & ((1 << bits) - 1)  # [R, C, per]
    out = fields.reshape(words.shape[0], words.shape[1] * per)
    return (out if dim == 1 else out.t()).to(torch.uint8).contiguous()


__all__ = ["CheckpointLinearMethod", "CheckpointQuantizationConfig", "GroupQuantizedTensor",
           "Int4GroupLinearMethod", "Int4GroupWeight", "kernel_layout", "pack_int4_groups",
           "require", "trivial_g_idx", "unpack_int32"]

"""Linear layers that know how to load their (fused) weights.

``MergedColumnLinear`` stacks several projections of the same input along the
output dimension (``gate_up_proj`` = [gate; up]); ``QKVLinear`` does the same
for q/k/v (as vLLM's ``QKVParallelLinear``), so one matmul serves all three::

    weight [q_size + 2 * kv_size, hidden]     rows: | q (H*D) | k (Hkv*D) | v (Hkv*D) |

Every layer computes through ``self.quant_method`` (a
:class:`~llmserve.layers.quantization.base.LinearMethodBase`), dense by default.
A layer that receives a quantized checkpoint tensor (``QuantizedTensor``) for its
weight switches to the method that tensor's config names (e.g. native GGUF 4-bit);
the model code never changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from llmserve.layers.quantization.base import (
    LinearMethodBase,
    QuantizedTensor,
    UnquantizedLinearMethod,
)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    with torch.no_grad():
        dst.copy_(src)  # casts to the parameter's dtype and device


def default_weight_loader(param: nn.Parameter,
                          loaded_weight: torch.Tensor | QuantizedTensor) -> None:
    """Copy a checkpoint tensor into ``param`` (cast to its dtype/device).

    A :class:`QuantizedTensor` (e.g. a GGUF Q8_0 embedding) is dequantized by its
    reference formula and kept on ``param.quantized_source`` for
    ``QuantizationConfig.process_model`` (which may run a tied LM head natively).

    Raises:
        ValueError: when the shapes differ.
    """
    if isinstance(loaded_weight, QuantizedTensor):
        _copy_checked(param.data, loaded_weight.dequantize(), "weight")
        param.quantized_source = loaded_weight
        return
    _copy_checked(param.data, loaded_weight, "weight")


class Linear(nn.Module):
    """``y = x W^T (+ b)``; weight ``[output_size, input_size]``, computed by ``quant_method``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.quant_method: LinearMethodBase = UnquantizedLinearMethod()
        # weight rows already loaded as (offset, size), in load order
        self.loaded_weight_rows: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, input_size]`` -> ``[num_tokens, output_size]``."""
        return self.quant_method.apply(self, x, self.bias)

    def matmul_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`forward` as a closure with its lookups done once (built on first use,
        rebuilt after any weight load): for hot loops such as the CPU decode path."""
        fn = self.__dict__.get("_matmul_fn")
        if fn is None:
            fn = self.__dict__["_matmul_fn"] = self.quant_method.make_matmul(self)
        return fn

    def shard_rows(self, shard_id: int | str | None) -> tuple[int, int]:
        """``(row offset, rows)`` of a shard in the (fused) weight; the whole weight for None."""
        return 0, self.output_size

    def weight_loader(self, param: nn.Parameter,
                      loaded_weight: torch.Tensor | QuantizedTensor,
                      shard_id: int | str | None = None) -> None:
        """Load a checkpoint tensor (or one shard of a fused weight) into ``param``.

        Args:
            param: ``self.weight`` or ``self.bias``.
            loaded_weight: ``[rows, input_size]`` (weight) or ``[rows]`` (bias), a float
                tensor or a :class:`QuantizedTensor` (then the layer switches to the
                method its config names, once, on the first quantized shard).
            shard_id: see :meth:`shard_rows`; None = the whole tensor.

        Raises:
            ValueError: on a shape mismatch or an unknown shard id.
        """
        self.__dict__.pop("_matmul_fn", None)
        offset, size = self.shard_rows(shard_id)
        what = "weight" if shard_id is None else f"shard {shard_id!r}"
        if param is not self.weight:  # bias: always dense
            if isinstance(loaded_weight, QuantizedTensor):
                loaded_weight = loaded_weight.dequantize()
            dst = param.data if shard_id is None else param.data.narrow(0, offset, size)
            _copy_checked(dst, loaded_weight, what)
            return
        expected = (size, self.input_size)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"{what}: expected shape {expected}, "
                             f"got {tuple(loaded_weight.shape)}")
        if isinstance(loaded_weight, QuantizedTensor) and \
                isinstance(self.quant_method, UnquantizedLinearMethod):
            self.quant_method = loaded_weight.config.get_linear_method(self)
        self.quant_method.load_weight(self, loaded_weight, offset)
        self.loaded_weight_rows.append((offset, size))


class MergedColumnLinear(Linear):
    """Several projections of one input fused along the output dimension.

    Shard ``i`` of ``output_sizes`` occupies rows
    ``sum(output_sizes[:i]) .. sum(output_sizes[:i + 1]) - 1``.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(input_size, sum(output_sizes), bias, dtype)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def shard_index(self, shard_id: int | str) -> int:
        i = int(shard_id)
        if not 0 <= i < len(self.output_sizes):
            raise ValueError(f"unknown shard {shard_id!r}; expected 0..{len(self.output_sizes) - 1}")
        return i

    def shard_rows(self, shard_id: int | str | None) -> tuple[int, int]:
        """Shard ``i`` -> ``(sum(output_sizes[:i]), output_sizes[i])``; None = the whole weight.

        Raises:
            ValueError: an unknown shard id.
        """
        if shard_id is None:
            return 0, self.output_size
        i = self.shard_index(shard_id)
        return self.offsets[i], self.output_sizes[i]


class QKVLinear(MergedColumnLinear):
    """Fused q/k/v projection; shard ids ``"q"``, ``"k"``, ``"v"``."""

    SHARDS = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias, dtype)

    def shard_index(self, shard_id: int | str) -> int:
        if shard_id not in self.SHARDS:
            raise ValueError(f"unknown qkv shard {shard_id!r}; expected one of {self.SHARDS}")
        return self.SHARDS.index(shard_id)

"""Quantization interfaces: a quantized checkpoint tensor, a linear method, a config.

Quantization replaces a layer's *method*, never the model code (DESIGN.md section 8)::

    loader --(QuantizedTensor)--> Linear.weight_loader --> layer.quant_method.load_weight
    model forward --> Linear.forward(x) --> layer.quant_method.apply(layer, x, bias)

A model file never asks "am I quantized?": it builds plain ``Linear`` layers; a
layer switches to the method its checkpoint tensor asks for when the first
quantized shard arrives (:meth:`QuantizationConfig.get_linear_method`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch import nn


class QuantizedTensor(ABC):
    """A checkpoint weight still in its quantized storage format.

    Invariants: ``shape`` is the Hugging Face ``[out_features, in_features]``
    (rows are output channels); :meth:`dequantize` is the format's reference
    formula, bit for bit; ``config`` is the :class:`QuantizationConfig` that
    asked the loader for it (it decides how the layer runs the weight).
    """

    shape: tuple[int, ...]
    config: QuantizationConfig

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[*shape]`` by the format's reference formula."""


class LinearMethodBase(ABC):
    """How a ``Linear`` layer stores its weight and computes ``y = x W^T + b``.

    Invariants:
      * :meth:`apply` maps ``x [num_tokens, input_size]`` (the model dtype) to
        ``[num_tokens, output_size]`` in the same dtype, equal to
        ``F.linear(x, W, bias)`` for the checkpoint's dequantized ``W`` up to the
        method's documented error bound;
      * a method never changes ``layer.input_size`` / ``layer.output_size``;
      * :meth:`load_weight` receives row slices ``[offset, offset + rows)`` of the
        (fused) weight in any order; each row is loaded exactly once.
    """

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        """``x [num_tokens, input_size]`` -> ``[num_tokens, output_size]``."""

    def make_matmul(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> apply(layer, x, layer.bias)`` with the per-call lookups done once: for
        hot loops (the CPU decode path), built after loading. Subclasses may return a
        leaner closure over their tensors."""
        bias = getattr(layer, "bias", None)
        return lambda x: self.apply(layer, x, bias)

    @abstractmethod
    def load_weight(self, layer: nn.Module, loaded: torch.Tensor | QuantizedTensor,
                    row_offset: int) -> None:
        """Store rows ``row_offset .. row_offset + loaded.shape[0] - 1`` of the weight.

        Raises:
            ValueError: when the shape does not fit the layer.
        """


class UnquantizedLinearMethod(LinearMethodBase):
    """A dense weight parameter ``layer.weight [output_size, input_size]`` in the model dtype."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def make_matmul(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        weight, bias = layer.weight, layer.bias
        return lambda x: F.linear(x, weight, bias)

    def load_weight(self, layer: nn.Module, loaded: torch.Tensor | QuantizedTensor,
                    row_offset: int) -> None:
        if isinstance(loaded, QuantizedTensor):
            loaded = loaded.dequantize()
        with torch.no_grad():  # shape checked by the layer; casts to the parameter's dtype
            layer.weight.data.narrow(0, row_offset, loaded.shape[0]).copy_(loaded)


class QuantizationConfig(ABC):
    """A weight format the engine can run natively (one per registry name).

    Invariants: :attr:`gguf_raw_types` names the GGUF tensor types (ggml type
    names, e.g. ``"Q4_1"``) the loader must hand over undequantized; every other
    tensor arrives as float32. :meth:`get_linear_method` returns a fresh method
    per layer. :meth:`process_model` runs once, after ``load_weights``;
    :meth:`fix_layouts` once after that, only where the layers stay where they are
    (no offload, no layer split).
    """

    name: str = ""
    gguf_raw_types: frozenset[str] = frozenset()

    @abstractmethod
    def get_linear_method(self, layer: nn.Module) -> LinearMethodBase:
        """The method a ``Linear`` layer switches to when it receives a :class:`QuantizedTensor`."""

    def process_model(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Finish after all weights are loaded (e.g. pack a tied embedding for the LM head)."""

    def fix_layouts(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Move weights into layouts that cannot be moved between devices or offload
        slots (oneDNN's packed tensors); called only where the layers stay put."""

"""Where each decoder layer runs: the layer split (``--n-gpu-layers``) and weight offload.

llama.cpp's ``--n-gpu-layers N`` (here ``num_device_layers``) puts N decoder layers on the
GPU and the rest on the CPU. This engine puts the *first* N layers (and their KV cache) on
the device and the rest on the CPU; the token embedding, final norm and LM head stay on the
CPU unless every layer is on the device (llama.cpp keeps its input layer on the CPU and
puts the output layer on the GPU only when all layers are). One step::

    input_ids, positions -> CPU: embed, RoPE table
      -> device: layers 0 .. N-1  (KV cache on the device; the runner's metadata)
      -> CPU:    layers N .. L-1  (KV cache in host memory; metadata rebuilt on the CPU)
      -> CPU: final norm, LM head -> logits -> the runner's device (sampling)

The hidden state (``[num_tokens, hidden_size]``), the residual and the RoPE rows move at
each boundary, so a step moves ``2 x num_tokens x hidden_size`` activations per boundary.
With ``--cpu-offload-gb`` the device layers' weights may also live in host memory
(:mod:`llmserve.worker.offload`). :class:`LayerHooks` is what the model calls before each
layer; on a CPU-only machine both "devices" are the CPU and the same code runs (every move,
the metadata rebuild, the weight copies).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from llmserve.layers.attention.backend import CommonAttentionMetadata
from llmserve.utils import format_size
from llmserve.worker.offload import (
    WeightOffloader,
    choose_offload_layers,
    layer_tensors,
    tensors_bytes,
)

logger = logging.getLogger(__name__)


def metadata_on(md: Any, device: torch.device, backend_cls: Any) -> Any:
    """The backend metadata ``md`` rebuilt with its tensors on ``device``.

    Raises:
        ValueError: metadata that does not carry its ``CommonAttentionMetadata``.
    """
    split = getattr(md, "split_of", None)
    if split is not None:  # a half of a mixed step (decodes | prefills)
        whole, half = split
        return metadata_on(whole, device, backend_cls).split_decodes()[half]
    common = md if isinstance(md, CommonAttentionMetadata) else getattr(md, "common", None)
    if common is None:
        raise ValueError(f"the layer split needs attention metadata that keeps its common "
                         f"metadata ({type(md).__name__} does not)")
    moved = dataclasses.replace(
        common, query_start_loc=common.query_start_loc.to(device),
        seq_lens=common.seq_lens.to(device), block_table=common.block_table.to(device),
        slot_mapping=common.slot_mapping.to(device))
    return backend_cls.build_metadata(moved)


class LayerHooks:
    """Called by the model before each decoder layer (``models/llama.py``).

    Args:
        offloader: streams offloaded layers' weights, or None.
        layer_devices: each layer's device under a split (None: no split).
        backend_cls: the attention backend (to rebuild metadata on another device).
    """

    def __init__(self, offloader: WeightOffloader | None,
                 layer_devices: list[torch.device] | None, backend_cls: Any) -> None:
        self.offloader = offloader
        self.layer_devices = layer_devices
        self.backend_cls = backend_cls
        self.input_device = None if layer_devices is None else torch.device("cpu")
        # layers where the hidden state changes device (always 0: inputs are on the CPU)
        self.boundaries = set() if layer_devices is None else {0} | {
            i for i in range(1, len(layer_devices)) if layer_devices[i] != layer_devices[i - 1]}
        self._runner_md = None
        self._cache: tuple[Any, Any] | None = None  # (runner metadata, host metadata)

    def inputs(self, input_ids: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` and ``positions`` on the embedding's device."""
        if self.input_device is None:
            return input_ids, positions
        return input_ids.to(self.input_device), positions.to(self.input_device)

    def before_layer(self, i: int, hidden: torch.Tensor, residual: torch.Tensor | None,
                     cos: torch.Tensor, sin: torch.Tensor, md: Any):
        """``(hidden, residual, cos, sin, attn_metadata)`` for layer ``i``, on its device;
        its weights resident."""
        if self.offloader is not None:
            self.offloader.load(i)
        if i not in self.boundaries:
            return hidden, residual, cos, sin, md
        if i == 0:
            self._runner_md = md
        dev = self.layer_devices[i]
        hidden, cos, sin = hidden.to(dev), cos.to(dev), sin.to(dev)
        residual = None if residual is None else residual.to(dev)
        if i == 0 and dev == torch.device(self._md_device(md)):
            return hidden, residual, cos, sin, md
        src = self._runner_md
        if self._cache is None or self._cache[0] is not src:
            self._cache = (src, metadata_on(src, torch.device("cpu"), self.backend_cls))
        return hidden, residual, cos, sin, (self._cache[1] if dev.type == "cpu" else src)

    def before_decode_layer(self, i: int) -> None:
        """The CPU decode path (every layer on the CPU): weights only."""
        if self.offloader is not None:
            self.offloader.load(i)

    @staticmethod
    def _md_device(md: Any) -> torch.device:
        slots = getattr(md, "slot_mapping", None)
        return slots.device if isinstance(slots, torch.Tensor) else torch.device("cpu")


def move_module(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)``, plus the tensors inside its quantization methods."""
    module.to(device)
    with torch.no_grad():
        for t in layer_tensors(module):
            if t.device != device:
                t.data = t.data.to(device)


def install_offload(model: nn.Module, config: Any) -> LayerHooks:
    """Place a model built on the CPU: the split, then the weight offload (module doc).

    Sets ``model.layer_devices`` (the runner allocates each layer's KV cache there) and
    ``model.offload_stats``.

    Raises:
        ValueError: ``cpu_offload_gb`` above the model's weight bytes, a split of a model
            whose decoder does not support it.
    """
    oc = config.offload_config
    inner = model.model
    layers = inner.layers
    num_layers = len(layers)
    device, host = torch.device(config.device), torch.device("cpu")
    n_dev = num_layers if oc.num_device_layers is None else oc.num_device_layers
    if n_dev < num_layers and not getattr(inner, "supports_layer_split", False):
        raise ValueError(f"num_device_layers (--n-gpu-layers) is not supported for "
                         f"{type(model).__name__} yet")
    layer_bytes = [tensors_bytes(layer_tensors(layer)) for layer in layers]
    model_bytes = _model_bytes(model)
    budget = oc.cpu_offload_bytes
    if budget > model_bytes:
        raise ValueError(f"cpu_offload_gb={oc.cpu_offload_gb} is more than the model's "
                         f"weights ({model_bytes / 1024**3:.3f} GiB)")
    offload_ids = choose_offload_layers(layer_bytes[:n_dev], budget) if budget else []
    if budget and not offload_ids:
        logger.warning("cpu_offload_gb=%s is smaller than one decoder layer (%s): nothing "
                       "offloaded", oc.cpu_offload_gb, format_size(layer_bytes[0]))
    outer_dev = device if n_dev == num_layers else host
    for name, child in inner.named_children():
        if name != "layers":
            move_module(child, outer_dev)
    if getattr(model, "lm_head", None) is not None:
        move_module(model.lm_head, outer_dev)
    for i, layer in enumerate(layers):
        if i not in offload_ids:
            move_module(layer, device if i < n_dev else host)
    offloader = WeightOffloader(layers, offload_ids, device) if offload_ids else None
    layer_devices = [device if i < n_dev else host for i in range(num_layers)]
    model.layer_devices = layer_devices
    model.offload_stats = offloader.stats if offloader else None
    hooks = LayerHooks(offloader, layer_devices if n_dev < num_layers else None,
                       model.attn_backend_cls)
    inner.layer_hooks = hooks
    if offloader is not None:
        s = offloader.stats
        logger.info("cpu offload: %d layers, %s of weights in host memory, streamed through "
                    "%s of device slots (%s per forward pass)", s.num_layers,
                    format_size(s.host_bytes), format_size(s.staging_bytes),
                    format_size(s.bytes_per_forward))
    if n_dev < num_layers:
        logger.info("layer split: layers 0..%d on %s, %d..%d (and embeddings, LM head) on "
                    "the CPU", n_dev - 1, device, n_dev, num_layers - 1)
    return hooks


def _model_bytes(model: nn.Module) -> int:
    from llmserve.worker.model_loading import model_weight_bytes

    return model_weight_bytes(model)

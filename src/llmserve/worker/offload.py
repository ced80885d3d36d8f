"""CPU offload of decoder-layer weights (``--cpu-offload-gb``), written for CUDA.

vLLM's offloaders (``vllm/model_executor/models/utils.py`` ``maybe_offload_to_cpu``, then
its prefetching offloader) keep part of the weights in host memory and bring them to the
device per layer. Here the first offloaded layers' tensors (parameters, buffers and the
tensors inside packed quantized weights) are copied once into one host buffer per layer
(pinned when the device is CUDA), which is their only persistent copy. On the device each
group of same-shaped layers shares two staging slots; a layer's tensors are views of its
slot, so every kernel (the module path, the CPU decode path's matmul closures) reads the
slot, and the slot holds that layer's bytes only after :meth:`WeightOffloader.load` ran::

    host (pinned, persistent)        device (two slots per layer shape)
    layer 0 bytes  --copy-->  slot A   layer 0 tensors = views of slot A
    layer 1 bytes  --copy-->  slot B   layer 1 tensors = views of slot B   (prefetched
    layer 2 bytes  --copy-->  slot A   (after layer 0 ran)                  on a side
                                                                            stream on CUDA)

On CUDA, ``load(i)`` makes the compute stream wait for layer ``i``'s copy and starts the
next offloaded layer's copy on a side stream (it waits for an event recorded before layer
``i``, so the slot's previous user, two layers back, has finished). On the CPU the copy is
synchronous; the code path is the same. Skipping a copy leaves the slot with another
layer's weights, so a bug here changes outputs (tests/test_offload.py).

Device memory saved: offloaded bytes minus the staging slots (two layers per shape);
bytes moved per step: the offloaded layers' bytes, once per forward pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

ALIGN = 64  # bytes: each tensor's offset in a slot (vector loads, any element size)


def _walk_tensors(obj: object, out: list[torch.Tensor], seen: set[int], depth: int = 0) -> None:
    """Tensors reachable from a quantization method / packed weight object (llmserve's own
    classes, lists, tuples and dicts), depth-first, each once."""
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _walk_tensors(item, out, seen, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            _walk_tensors(item, out, seen, depth + 1)
    elif type(obj).__module__.startswith("llmserve.") and not isinstance(obj, nn.Module):
        names = list(getattr(obj, "__dict__", {}))
        names += [s for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]
        for name in names:
            _walk_tensors(getattr(obj, name), out, seen, depth + 1)


def layer_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """The dense tensors ``layer`` computes with: parameters, buffers and the tensors of
    each submodule's ``quant_method`` (packed GGUF / int4 weights), each once; meta and
    non-strided (opaque) tensors are left out (they stay where they are)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in layer.modules():
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if id(t) not in seen:
                seen.add(id(t))
                found.append(t)
        qm = getattr(module, "quant_method", None)
        if qm is not None:
            _walk_tensors(qm, found, seen)
    return [t for t in found if t.device.type != "meta" and t.layout == torch.strided
            and t.numel() > 0]


def _layout(tensors: list[torch.Tensor]) -> tuple[tuple, list[int], int]:
    """``(signature, byte offsets, total bytes)`` of ``tensors`` packed into one buffer."""
    offsets, off = [], 0
    for t in tensors:
        offsets.append(off)
        off += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    signature = tuple((tuple(t.shape), t.dtype) for t in tensors)
    return signature, offsets, off


def _view(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor shaped as ``like`` over ``buf[offset:]`` (uint8)."""
    nbytes = like.numel() * like.element_size()
    return buf[offset:offset + nbytes].view(like.dtype).view(like.shape)


@dataclass
class _OffloadedLayer:
    index: int
    host: torch.Tensor  # [nbytes] uint8, the only persistent copy (pinned on CUDA)
    slot: torch.Tensor  # [nbytes] uint8 on the device, shared with other layers
    nbytes: int


@dataclass
class OffloadStats:
    """What offloading moved off the device (bytes)."""

    num_layers: int = 0
    host_bytes: int = 0  # weights whose only copy is in host memory
    staging_bytes: int = 0  # device slots they are streamed through
    bytes_per_forward: int = 0  # host -> device bytes per forward pass
    layers: list[int] = field(default_factory=list)


class WeightOffloader:
    """Streams the weights of ``offload_ids`` layers from host memory (module doc).

    Args:
        layers: the model's decoder layers (already on ``device``).
        offload_ids: indices of the layers to offload.
        device: the compute device (``cpu`` runs the same path synchronously).

    Raises:
        ValueError: a layer without weights to offload.
    """

    def __init__(self, layers: nn.ModuleList, offload_ids: list[int],
                 device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.layers: dict[int, _OffloadedLayer] = {}
        self.stats = OffloadStats(layers=list(offload_ids))
        groups: dict[tuple, list[tuple[int, list[torch.Tensor], list[int], int]]] = {}
        for i in offload_ids:
            tensors = layer_tensors(layers[i])
            if not tensors:
                raise ValueError(f"layer {i} has no weights to offload")
            sig, offsets, nbytes = _layout(tensors)
            groups.setdefault(sig, []).append((i, tensors, offsets, nbytes))
        for members in groups.values():
            nbytes = members[0][3]
            slots = [torch.empty(nbytes, dtype=torch.uint8, device=device)
                     for _ in range(min(2, len(members)))]
            self.stats.staging_bytes += nbytes * len(slots)
            for k, (i, tensors, offsets, _) in enumerate(members):
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
                slot = slots[k % len(slots)]
                with torch.no_grad():
                    for t, off in zip(tensors, offsets):
                        _view(host, off, t).copy_(t)
                        t.data = _view(slot, off, t)  # the device copy is gone
                self.layers[i] = _OffloadedLayer(i, host, slot, nbytes)
                self.stats.host_bytes += nbytes
        self.stats.num_layers = len(self.layers)
        self.stats.bytes_per_forward = self.stats.host_bytes
        self._order = sorted(self.layers)
        self._next = {a: b for a, b in zip(self._order, self._order[1:])}
        self._pending: dict[int, torch.cuda.Event] = {}
        self._last = -1
        self._stream = torch.cuda.Stream(device) if self.cuda else None

    def load(self, i: int) -> None:
        """Make layer ``i``'s weights resident in its slot (if offloaded) and prefetch the
        next offloaded layer's; call just before layer ``i`` runs, layers in order."""
        if i <= self._last:  # a new forward pass: nothing prefetched is trusted
            if self.cuda:  # (an abandoned prefetch must land before its slot is reused)
                for event in self._pending.values():
                    torch.cuda.current_stream(self.device).wait_event(event)
            self._pending.clear()
        self._last = i
        entry = self.layers.get(i)
        if entry is None:
            return
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            done = self._pending.pop(i, None)
            if done is None:
                entry.slot.copy_(entry.host, non_blocking=True)
            else:
                compute.wait_event(done)
            nxt = self._next.get(i)
            if nxt is not None:  # prefetch: after everything before layer i has run
                before_i = compute.record_event()
                nentry = self.layers[nxt]
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(before_i)
                    nentry.slot.copy_(nentry.host, non_blocking=True)
                    self._pending[nxt] = self._stream.record_event()
        else:
            entry.slot.copy_(entry.host)


def choose_offload_layers(layer_bytes: list[int], budget: int) -> list[int]:
    """vLLM's rule at layer granularity: offload layers from the first while the total
    stays within ``budget`` bytes."""
    chosen, total = [], 0
    for i, nbytes in enumerate(layer_bytes):
        if total + nbytes > budget:
            break
        chosen.append(i)
        total += nbytes
    return chosen


def tensors_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)

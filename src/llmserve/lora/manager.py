"""Worker-side adapter management: wrap the model's projections, keep adapters in
memory, put the ones a step needs into slots (vLLM's ``LoRAModelManager`` +
``WorkerLoRAManager``, in one small class).

::

    LoRARequest(name, id, path) --load (PEFT dir)--> cache (LRU, max_cpu_loras adapters)
                                 --step needs it--> slot 0..max_loras-1 of every LoRALinear
    each step: rows of request i -> its adapter's slot (-1: base)  -> PunicaWrapper

The scheduler admits at most ``max_loras`` distinct adapters into the running batch,
so a step's adapters always fit the slots.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from llmserve.layers.linear import Linear
from llmserve.lora.layers import LoRALinear, PunicaWrapper
from llmserve.lora.peft import PeftAdapter, load_peft_adapter
from llmserve.lora.request import LoRARequest

# our module name -> PEFT target names it can carry (q/k/v fused, gate/up fused)
SUPPORTED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_TARGETS = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"


class LoRAModelManager:
    """Adapters of one model.

    Args:
        model: a loaded model whose attention/MLP projections are
            :class:`~llmserve.layers.linear.Linear` layers; they are replaced in place by
            :class:`~llmserve.lora.layers.LoRALinear` wrappers (base weights untouched).
        max_loras: adapter slots (distinct adapters in one step).
        max_lora_rank: the largest rank accepted (slots are padded to it).
        max_cpu_loras: adapters kept in memory (least recently used dropped first);
            None = ``max_loras``.

    Raises:
        ValueError: the model has no projection LoRA can wrap, or bad limits.
    """

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.dtype = dtype
        self.punica = PunicaWrapper()
        # Hugging Face module name -> (wrapped layer, slice index)
        self.targets: dict[str, tuple[LoRALinear, int]] = {}
        self.layers: list[LoRALinear] = []
        packed = getattr(model, "packed_modules_mapping", {})
        for name, module in list(model.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, LoRALinear):  # a second engine on the same weights: its
                # wrappers replace the first engine's (whose adapters then no longer apply)
                module = module.base_layer
            if leaf not in SUPPORTED_MODULES or not isinstance(module, Linear):
                continue
            if getattr(module, "tp_size", 1) > 1:
                raise ValueError("LoRA adapters with tensor parallelism are not supported "
                                 "yet; serve with --tensor-parallel-size 1")
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            if leaf in packed and hasattr(module, "output_sizes"):
                names = [orig for orig, _ in packed[leaf]]
                slices = [(n, off, size) for n, off, size in
                          zip(names, module.offsets, module.output_sizes, strict=True)]
            else:
                slices = [(leaf, 0, module.output_size)]
            wrapped = LoRALinear(module, slices, self.punica, max_loras, max_lora_rank,
                                 dtype, torch.device(device))
            setattr(parent, leaf, wrapped)
            self.layers.append(wrapped)
            prefix = name.rsplit(".", 1)[0]
            for i, (hf_name, _, _) in enumerate(slices):
                self.targets[f"{prefix}.{hf_name}"] = (wrapped, i)
        if not self.layers:
            raise ValueError(f"LoRA: {type(model).__name__} has no projection LoRA can adapt "
                             f"({_TARGETS})")
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, tuple[LoRARequest, PeftAdapter]] = OrderedDict()
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id per slot
        self._slot_lru: list[int] = list(range(max_loras))  # least recently used first
        self._slot_src: dict[int, PeftAdapter] = {}  # the weights each slot was written from

    # ------------------------------------------------------------------ adapters
    def _validate(self, req: LoRARequest, adapter: PeftAdapter) -> None:
        if adapter.rank > self.max_lora_rank:
            raise ValueError(f"LoRA adapter {req.lora_name!r}: rank {adapter.rank} is larger "
                             f"than max_lora_rank ({self.max_lora_rank}); raise "
                             "--max-lora-rank")
        for module, w in adapter.weights.items():
            if module not in self.targets:
                raise ValueError(f"LoRA adapter {req.lora_name!r}: module {module!r} cannot "
                                 f"be adapted (supported targets: {_TARGETS})")
            layer, i = self.targets[module]
            _, _, size = layer.slices[i]
            if w.lora_a.shape[1] != layer.input_size or w.lora_b.shape[0] != size:
                raise ValueError(
                    f"LoRA adapter {req.lora_name!r}: module {module!r} maps "
                    f"{w.lora_a.shape[1]} -> {w.lora_b.shape[0]} features, the model's "
                    f"{layer.input_size} -> {size} (an adapter for another base model?)")

    def add_adapter(self, req: LoRARequest) -> None:
        """Load (or refresh the LRU position of) ``req``'s adapter; thread-safe.

        Raises:
            ValueError: an unreadable or unsupported adapter, a rank above
                ``max_lora_rank``, or modules/shapes that do not fit this model.
        """
        with self._lock:
            hit = self._cache.get(req.lora_int_id)
            if hit is not None and hit[0] == req:
                self._cache.move_to_end(req.lora_int_id)
                return
        adapter = load_peft_adapter(req.lora_path, self.dtype)
        self._validate(req, adapter)
        with self._lock:
            self._cache[req.lora_int_id] = (req, adapter)
            self._cache.move_to_end(req.lora_int_id)
            while len(self._cache) > self.max_cpu_loras:
                old = next(iter(self._cache))
                self._cache.pop(old)

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Drop an adapter from memory and its slot (a running request that still uses
        it reloads it from its path). Returns whether it was loaded."""
        with self._lock:
            found = self._cache.pop(lora_int_id, None) is not None
        return found

    def list_adapters(self) -> list[int]:
        with self._lock:
            return list(self._cache)

    def _activate(self, req: LoRARequest, keep: set[int]) -> int:
        """The slot holding ``req``'s adapter, written there first if needed."""
        lid = req.lora_int_id
        with self._lock:
            hit = self._cache.get(lid)
        if hit is None or hit[0] != req:
            self.add_adapter(req)
            with self._lock:
                hit = self._cache[lid]
        if lid in self.slots:
            slot = self.slots.index(lid)
            if self._slot_src.get(slot) is hit[1]:
                self._touch(slot)
                return slot
        else:
            slot = next((s for s in self._slot_lru if self.slots[s] is None or
                         self.slots[s] not in keep), None)
            if slot is None:
                raise RuntimeError(f"LoRA: more than max_loras ({self.max_loras}) adapters "
                                   "in one step")
        adapter = hit[1]
        per_layer: dict[int, list] = {}
        for layer in self.layers:
            per_layer[id(layer)] = [None] * len(layer.slices)
        for module, w in adapter.weights.items():
            layer, i = self.targets[module]
            per_layer[id(layer)][i] = (w.lora_a, w.lora_b)
        for layer in self.layers:
            layer.set_slot(slot, per_layer[id(layer)])
        self.slots[slot] = lid
        self._slot_src[slot] = adapter
        self._touch(slot)
        return slot

    def _touch(self, slot: int) -> None:
        self._slot_lru.remove(slot)
        self._slot_lru.append(slot)

    # ------------------------------------------------------------------ steps
    def prepare_step(self, rows: Sequence[tuple[LoRARequest | None, int]],
                     num_decodes: int) -> None:
        """Map this step's rows to slots: ``rows`` = ``(adapter or None, num_tokens)`` per
        request in row order; ``num_decodes`` = the leading one-token decode rows."""
        needed = {r.lora_int_id for r, _ in rows if r is not None}
        slot_of: dict[int, int] = {}
        for req, _ in rows:
            if req is not None and req.lora_int_id not in slot_of:
                slot_of[req.lora_int_id] = self._activate(req, needed)
        token_slots: list[int] = []
        for req, n in rows:
            token_slots.extend([slot_of[req.lora_int_id] if req is not None else -1] * n)
        self.punica.update(token_slots, num_decodes)


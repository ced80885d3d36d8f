"""Batched multi-LoRA around a base linear layer (Punica / S-LoRA style, in torch).

One step holds tokens of several adapters (and of none). Every adapted layer keeps the
weights of ``max_loras`` adapter *slots* stacked, rank padded to ``max_lora_rank``::

    lora_a  [max_loras, num_slices * R, in_features]       shrink, all slices at once
    lora_b  [max_loras, output_size, num_slices * R]       expand, block-diagonal over
                                                           the slices, scaling folded in
    y = base(x)                                            any linear method (dense,
                                                           GGUF native int4, ...)
    for each adapter slot s present in the step (its token rows g):
        y[g] += (x[g] @ lora_a[s]^T) @ lora_b[s]^T         [n_g, num_slices * R] between

              lora_b[s] for q|k|v:  | B_q  0    0   |   rows of q
                                    | 0    B_k  0   |   rows of k
                                    | 0    0    B_v |   rows of v

The tokens of one adapter are gathered (segmented matmul: one shrink and one expand per
adapter and slice, whatever the number of its requests), never one pass of the base
model per adapter. A fused projection (``qkv_proj`` = q|k|v, ``gate_up_proj`` =
gate|up) has one slice per checkpoint projection; an adapter that leaves a slice out
has zeros there. Source: Chen et al. 2023 (Punica, SGMV); Sheng et al. 2023 (S-LoRA);
vLLM ``lora/punica_wrapper`` and ``lora/layers``.

The per-step token -> slot mapping lives in one :class:`PunicaWrapper` that every
wrapped layer holds (as vLLM's), set by the model runner before each forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Rows = slice | torch.Tensor  # contiguous rows, or an int64 row index


class PunicaWrapper:
    """The step's grouping of token rows by adapter slot.

    :meth:`update` takes each row's slot (-1: no adapter). The LLaMA model may run a
    mixed step's decode rows and prompt rows as two passes (``LlamaModel.forward``):
    a layer then sees ``num_decodes`` rows first and the other rows second, and
    :meth:`groups_for` hands it the matching part of the mapping.
    """

    def __init__(self) -> None:
        self.step = 0
        self.num_tokens = 0
        self.num_decodes = 0
        self._slots: list[int] = []
        self.has_lora = False  # any row of this step uses an adapter
        self._groups: dict[tuple[int, int], list[tuple[int, Rows]]] = {}

    def update(self, token_slots: list[int], num_decodes: int) -> None:
        """Set the mapping for the next forward: ``token_slots[t]`` = row ``t``'s slot."""
        self.step += 1
        self.num_tokens = len(token_slots)
        self.num_decodes = num_decodes
        self._slots = token_slots
        self.has_lora = any(s >= 0 for s in token_slots)
        self._groups = {}

    def _build(self, start: int, n: int) -> list[tuple[int, Rows]]:
        rows_of: dict[int, list[int]] = {}
        for t in range(start, start + n):
            s = self._slots[t]
            if s >= 0:
                rows_of.setdefault(s, []).append(t - start)
        groups: list[tuple[int, Rows]] = []
        for s, rows in rows_of.items():
            if rows[-1] - rows[0] + 1 == len(rows):  # contiguous: a plain slice
                groups.append((s, slice(rows[0], rows[-1] + 1)))
            else:
                groups.append((s, torch.tensor(rows, dtype=torch.long)))
        return groups

    def groups_for(self, num_rows: int, first_call: bool) -> list[tuple[int, Rows]]:
        """``(slot, rows)`` of the ``num_rows`` rows a layer sees now.

        Raises:
            RuntimeError: ``num_rows`` matches neither the step nor one of its passes.
        """
        if num_rows == self.num_tokens:
            start = 0
        elif first_call and num_rows == self.num_decodes:
            start = 0  # the decode pass of a split step
        elif num_rows == self.num_tokens - self.num_decodes:
            start = self.num_decodes  # its prompt pass
        else:
            raise RuntimeError(f"LoRA: a layer got {num_rows} rows in a step of "
                               f"{self.num_tokens} tokens ({self.num_decodes} decodes)")
        key = (start, num_rows)
        groups = self._groups.get(key)
        if groups is None:
            groups = self._groups[key] = self._build(start, num_rows)
        return groups


class LoRALinear(nn.Module):
    """A base :class:`~llmserve.layers.linear.Linear` plus the stacked adapters of its
    slices (module docstring). ``forward`` and ``matmul_fn`` keep the base layer's
    contract: ``[num_tokens, input_size]`` -> ``[num_tokens, output_size]``.

    Args:
        base_layer: the loaded base linear (any ``quant_method``).
        slices: ``(Hugging Face projection name, row offset, rows)`` per output slice.
        punica: the step's token grouping, shared by every wrapped layer.
        max_loras: adapter slots; max_lora_rank: ``R``; dtype, device: of the activations.
    """

    def __init__(self, base_layer: nn.Module, slices: list[tuple[str, int, int]],
                 punica: PunicaWrapper, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.slices = slices
        self.punica = punica
        self.max_lora_rank = max_lora_rank
        self.input_size = base_layer.input_size
        self.output_size = base_layer.output_size
        # [max_loras, num_slices * R, in_features]
        self.lora_a = torch.zeros(max_loras, len(slices) * max_lora_rank, self.input_size,
                                  dtype=dtype, device=device)
        # [max_loras, output_size, num_slices * R], block-diagonal (slice i: its rows, i*R..)
        self.lora_b = torch.zeros(max_loras, self.output_size, len(slices) * max_lora_rank,
                                  dtype=dtype, device=device)
        self._seen_step = -1

    # the base layer's attributes that other code reads
    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @property
    def quant_method(self):
        return self.base_layer.quant_method

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter into ``slot``: per slice ``(A [r, in], B [size, r])`` or None
        (that slice not adapted: zeros). Ranks below ``R`` are zero-padded."""
        R = self.max_lora_rank
        self.clear_slot(slot)
        for i, w in enumerate(weights):
            if w is None:
                continue
            a, b = w
            r = a.shape[0]
            _, offset, size = self.slices[i]
            self.lora_a[slot, i * R:i * R + r].copy_(a)
            self.lora_b[slot, offset:offset + size, i * R:i * R + r].copy_(b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def add_lora(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y += x @ A[slot]^T @ B[slot]^T`` for each adapter's rows, in place."""
        p = self.punica
        if not p.has_lora:
            return y
        first = self._seen_step != p.step
        self._seen_step = p.step
        for slot, rows in p.groups_for(x.shape[0], first):
            if isinstance(rows, slice):  # contiguous rows: expand and add in one call
                shrunk = x[rows] @ self.lora_a[slot].t()  # [n_g, num_slices * R]
                y[rows].addmm_(shrunk, self.lora_b[slot].t())
            else:
                shrunk = x.index_select(0, rows) @ self.lora_a[slot].t()
                y.index_add_(0, rows, shrunk @ self.lora_b[slot].t())
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(self.base_layer.forward(x), x)

    def matmul_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The base layer's closure followed by the adapters (the CPU decode path)."""
        base_fn = self.base_layer.matmul_fn()
        add = self.add_lora
        return lambda x: add(base_fn(x), x)

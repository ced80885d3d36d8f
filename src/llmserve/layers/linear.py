"""Linear layers that know how to load their (fused) weights.

``MergedColumnLinear`` stacks several projections of the same input along the
output dimension (``gate_up_proj`` = [gate; up]); ``QKVLinear`` does the same
for q/k/v (as vLLM's ``QKVParallelLinear``), so one matmul serves all three::

    weight [q_size + 2 * kv_size, hidden]     rows: | q (H*D) | k (Hkv*D) | v (Hkv*D) |
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    with torch.no_grad():
        dst.copy_(src)  # casts to the parameter's dtype and device


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into ``param`` (cast to its dtype/device).

    Raises:
        ValueError: when the shapes differ.
    """
    _copy_checked(param.data, loaded_weight, "weight")


class Linear(nn.Module):
    """``y = x W^T (+ b)``; weight ``[output_size, input_size]``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, input_size]`` -> ``[num_tokens, output_size]``."""
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        """Copy a whole checkpoint tensor. Raises ValueError on a shape mismatch."""
        default_weight_loader(param, loaded_weight)


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
        return int(shard_id)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        """Copy one shard (``weight`` ``[size, input_size]`` or ``bias`` ``[size]``).

        Raises:
            ValueError: on a shape mismatch or an unknown shard id.
        """
        if shard_id is None:
            return super().weight_loader(param, loaded_weight)
        i = self.shard_index(shard_id)
        rows = param.data.narrow(0, self.offsets[i], self.output_sizes[i])
        _copy_checked(rows, loaded_weight, f"shard {shard_id!r}")


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

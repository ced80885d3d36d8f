"""Tensor-parallel linear layers (Megatron-LM, arXiv:1909.08053, section 3; vLLM's
``ColumnParallelLinear`` / ``RowParallelLinear``). Each layer loads its own shard of
the full checkpoint tensor::

    column parallel  W [out, in]  ->  rank r holds rows  r*out/tp .. (r+1)*out/tp   y_r = x W_r^T
    row parallel     W [out, in]  ->  rank r holds cols  r*in/tp  .. (r+1)*in/tp    y = sum_r x_r W_r^T
                                                                   (all-reduce, then + bias)

A fused layer splits each of its parts (q | k | v, gate | up), never the fused tensor::

    QKV, tp=2, 14 q heads, 2 kv heads:    rank 0: q heads 0..6  | k head 0 | v head 0
                                          rank 1: q heads 7..13 | k head 1 | v head 1
    tp > kv heads (tp=3, 3 q / 1 kv):     rank r: q heads r     | kv head r // (tp / kv)

Quantized shards: a GGUF tensor is cut in its block layout (rows: whole byte rows;
columns: whole blocks), so the int4 / GGUF kernels run the shard natively; a cut
that is not on a block boundary, or another quantized format, is dequantized first
(that shard then runs dense). Sizes are the *local* ones: ``input_size`` /
``output_size`` of a parallel layer are what this rank computes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmserve.distributed.parallel_state import GroupCoordinator
from llmserve.layers.linear import Linear, MergedColumnLinear, QKVLinear
from llmserve.layers.quantization.base import QuantizedTensor
from llmserve.layers.quantization.gguf_blocks import BLOCK_LAYOUT, GGUFQuantizedTensor


def narrow_weight(t: torch.Tensor | QuantizedTensor, dim: int, start: int,
                  size: int) -> torch.Tensor | QuantizedTensor:
    """``t.narrow(dim, start, size)`` for a float tensor or a quantized checkpoint tensor.

    A :class:`GGUFQuantizedTensor` stays quantized when the cut keeps whole rows
    (``dim=0``) or whole blocks (``dim=1``, ``start`` and ``size`` multiples of the
    type's block); otherwise (and for other formats) it is dequantized, then cut.
    """
    if isinstance(t, GGUFQuantizedTensor) and t.blocks.ndim == 2:
        rows, cols = t.shape
        if dim == 0:
            return GGUFQuantizedTensor(t.qtype, (size, cols), t.blocks[start:start + size],
                                       t.config)
        qb, bb = BLOCK_LAYOUT[t.qtype]
        if start % qb == 0 and size % qb == 0:
            blocks = t.blocks[:, start // qb * bb:(start + size) // qb * bb]
            return GGUFQuantizedTensor(t.qtype, (rows, size), blocks, t.config)
    if isinstance(t, QuantizedTensor):
        t = t.dequantize()
    return t.narrow(dim, start, size)


class MergedColumnParallelLinear(MergedColumnLinear):
    """Column-parallel ``[gate; up]``: each part split over the tp ranks.

    Args:
        output_sizes: the *full* size of each part (each divisible by ``tp.world_size``).
        tp: the tensor-parallel group.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 dtype: torch.dtype, tp: GroupCoordinator) -> None:
        n = tp.world_size
        if any(s % n for s in output_sizes):
            raise ValueError(f"tp={n} does not divide the output sizes {output_sizes}")
        super().__init__(input_size, [s // n for s in output_sizes], bias, dtype)
        self.tp = tp
        self.full_output_sizes = list(output_sizes)

    def shard_start(self, i: int) -> int:
        """First row of part ``i`` of the full checkpoint tensor that this rank holds."""
        return self.tp.rank_in_group * self.output_sizes[i]

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        """Load part ``shard_id`` (or the whole fused tensor) of the *full* checkpoint."""
        if shard_id is None:  # a checkpoint that stores the fused tensor: split it first
            offset = 0
            for i, full in enumerate(self.full_output_sizes):
                self.weight_loader(param, narrow_weight(loaded_weight, 0, offset, full),
                                   self._shard_key(i))
                offset += full
            return
        i = self.shard_index(shard_id)
        super().weight_loader(param, narrow_weight(loaded_weight, 0, self.shard_start(i),
                                                   self.output_sizes[i]), shard_id)

    def _shard_key(self, i: int) -> int | str:
        return i


class QKVParallelLinear(QKVLinear):
    """Column-parallel fused q/k/v by heads; KV heads replicated when tp > num_kv_heads.

    Args:
        total_num_heads, total_num_kv_heads: the model's (full) head counts.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool, dtype: torch.dtype,
                 tp: GroupCoordinator) -> None:
        n, r = tp.world_size, tp.rank_in_group
        if total_num_heads % n or (total_num_kv_heads % n and n % total_num_kv_heads):
            raise ValueError(f"tp={n} does not split {total_num_heads} query and "
                             f"{total_num_kv_heads} KV heads")
        self.num_heads = total_num_heads // n
        self.num_kv_heads = max(1, total_num_kv_heads // n)
        super().__init__(hidden_size, head_dim, self.num_heads, self.num_kv_heads, bias, dtype)
        self.tp = tp
        self.head_dim = head_dim
        self.full_sizes = [total_num_heads * head_dim, total_num_kv_heads * head_dim,
                           total_num_kv_heads * head_dim]
        kv_head = (r * self.num_kv_heads if total_num_kv_heads >= n
                   else r // (n // total_num_kv_heads))
        self.starts = {"q": r * self.q_size, "k": kv_head * head_dim, "v": kv_head * head_dim}

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        """Load ``q`` / ``k`` / ``v`` (or the fused tensor) of the *full* checkpoint."""
        if shard_id is None:
            offset = 0
            for key, full in zip(self.SHARDS, self.full_sizes):
                self.weight_loader(param, narrow_weight(loaded_weight, 0, offset, full), key)
                offset += full
            return
        i = self.shard_index(shard_id)
        super().weight_loader(param, narrow_weight(loaded_weight, 0, self.starts[shard_id],
                                                   self.output_sizes[i]), shard_id)


class RowParallelLinear(Linear):
    """Row-parallel: this rank holds input columns ``r*in/tp .. (r+1)*in/tp`` and the
    partial products are summed over the group (all-reduce, in float32), then the
    bias is added once.

    Args:
        input_size: the *full* input size (divisible by ``tp.world_size``).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 tp: GroupCoordinator) -> None:
        if input_size % tp.world_size:
            raise ValueError(f"tp={tp.world_size} does not divide input size {input_size}")
        super().__init__(input_size // tp.world_size, output_size, bias, dtype)
        self.tp = tp

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        """Load this rank's input columns of the *full* ``[out, in]`` weight (a bias whole)."""
        if param is self.weight:
            loaded_weight = narrow_weight(loaded_weight, 1,
                                          self.tp.rank_in_group * self.input_size,
                                          self.input_size)
        super().weight_loader(param, loaded_weight, shard_id)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        if not y.is_contiguous():
            y = y.contiguous()
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, input_size / tp]`` -> ``[num_tokens, output_size]`` (reduced)."""
        return self._reduce(self.quant_method.apply(self, x, None))

    def matmul_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The method's lean closure without the bias, then all-reduce and bias."""
        fn = self.__dict__.get("_matmul_fn")
        if fn is None:
            bias = self.bias
            self.bias = None  # the closure must not add the bias on every rank
            try:
                partial = self.quant_method.make_matmul(self)
            finally:
                self.bias = bias
            reduce = self._reduce

            def fn(x: torch.Tensor) -> torch.Tensor:
                return reduce(partial(x))
            self.__dict__["_matmul_fn"] = fn
        return fn

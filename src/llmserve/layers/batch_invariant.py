"""Batch-invariant ("deterministic") mode: a token's bits never depend on its step.

With ``--deterministic`` (vLLM's batch-invariant mode, SGLang's
``--enable-deterministic-inference``; Thinking Machines, "Defeating
Nondeterminism in LLM Inference", 2025) greedy outputs and logprobs do not
change with batching, prefill chunking or prefix-cache hits. Two rules:

* every query token is computed as a one-token decode (the runner rewrites a
  step's attention metadata, ``per_token_metadata``): the C decode kernel reads
  its paged KV block by block and sums over positions in one fixed order, and
  every row of every matmul takes the CPU decode path's closure, so a prompt
  token chunked or not, cached or not, batched or not, runs the same kernels;
* each matmul kernel gives a row the same bits for any number of rows. The
  packed GGUF kernels do (``gguf_native``); oneDNN's dense GEMMs do not (float32:
  its kernel choice changes with M, measured at M = 1, 4, 16; bfloat16: M = 1),
  so dense layers here run in zero-padded chunks of exactly ``CHUNK_ROWS`` rows,
  which gives every row the same bits (measured, float32 and bfloat16, K up to 8960).

Cost (docs/benchmarks.md): prompt tokens run the decode kernel (attention over
their whole prefix, one token at a time) and the packed matmul, slower than the
prefill path's flash attention and dense GEMM; decode steps are unchanged.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from llmserve.layers.moe import FusedMoE
from llmserve.layers.quantization.base import UnquantizedLinearMethod

CHUNK_ROWS = 16


def chunked_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None,
                   chunk_rows: int = CHUNK_ROWS, linear=F.linear) -> torch.Tensor:
    """``linear(x [M, K], weight, bias)`` -> ``[M, N]`` (default ``F.linear``, weight
    ``[N, K]``), computed on zero-padded chunks of exactly ``chunk_rows`` rows (every
    GEMM call has one shape)."""
    m = x.shape[0]
    pad = -m % chunk_rows
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if x.shape[0] == chunk_rows:
        return linear(x, weight, bias)[:m]
    return torch.cat([linear(c, weight, bias) for c in x.split(chunk_rows)])[:m]


class BatchInvariantLinearMethod(UnquantizedLinearMethod):
    """A dense weight, multiplied by :func:`chunked_linear` (module and decode paths)."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return chunked_linear(x, layer.weight, bias)

    def make_matmul(self, layer: nn.Module):
        weight, bias = layer.weight, layer.bias
        return lambda x: chunked_linear(x, weight, bias)


class BatchInvariantWeight(torch.Tensor):
    """A dense LM-head table whose ``F.linear(x, self)`` runs :func:`chunked_linear`;
    every other op (the embedding lookup) sees a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func is F.linear and len(args) >= 2 and isinstance(args[1], cls) \
                    and args[0].dim() == 2:
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return chunked_linear(args[0], args[1], bias)
            out = func(*args, **kwargs)
            if func is torch.Tensor.detach:  # nn.Parameter(...) keeps the subclass
                return out.as_subclass(cls)
            return out


def make_batch_invariant(model: nn.Module) -> None:
    """Switch a loaded model's dense matmuls (linear layers, MoE experts, LM head) to
    :func:`chunked_linear`. Packed GGUF layers are row-invariant already."""
    for module in model.modules():
        if isinstance(module, FusedMoE):  # an expert's rows: the tokens routed to it
            module.linear = chunked_linear
        if type(getattr(module, "quant_method", None)) is UnquantizedLinearMethod:
            module.quant_method = BatchInvariantLinearMethod()
            module.__dict__.pop("_matmul_fn", None)
    lm_head = getattr(model, "lm_head", None)
    holder = model.model.embed_tokens if lm_head is None else lm_head
    weight = holder.weight
    if type(weight) in (torch.Tensor, nn.Parameter) and weight.device.type != "meta":
        holder.weight = nn.Parameter(weight.data.as_subclass(BatchInvariantWeight),
                                     requires_grad=False)


def per_token_metadata(query_lens: list[int], positions: np.ndarray,
                       block_table: np.ndarray) -> tuple[list[int], list[int], np.ndarray]:
    """A step's sequences rewritten as one-token decodes, one per query token.

    Args:
        query_lens: tokens of each sequence this step (``[num_seqs]``).
        positions: ``[num_tokens]`` each token's position in its sequence.
        block_table: ``[num_seqs, max_blocks]`` int64.

    Returns:
        ``(query_lens, seq_lens, block_table)`` of the pseudo-sequences: ``[1] * T``,
        ``position + 1`` (the token sees itself and every earlier position, the ones
        of this step included: attention writes this step's K/V first), and each
        token's sequence's block table row ``[T, max_blocks]``.
    """
    table = np.repeat(block_table, query_lens, axis=0)
    return [1] * len(positions), (positions + 1).tolist(), table

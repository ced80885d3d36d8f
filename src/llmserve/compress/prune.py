"""Weight pruning: magnitude, Wanda and SparseGPT, 2:4 or unstructured, layer by layer.

Each decoder linear ``W [N, K]`` (N outputs, K inputs) gets a mask:

- ``magnitude``: score ``|W|``; unstructured keeps the largest over the whole matrix.
- ``wanda`` (Sun et al., "A Simple and Effective Pruning Approach for Large Language
  Models", ICLR 2024): score ``|W_ij| * ||X_j||_2`` with ``X`` the layer's calibration
  inputs; unstructured compares within each output row (the paper's choice).
- ``sparsegpt`` (Frantar & Alistarh, "SparseGPT: Massive Language Models Can Be
  Accurately Pruned in One-Shot", ICML 2023, Algorithm 1; read in IST-DASLab/sparsegpt,
  not copied): columns in blocks of 128, mask by ``w^2 / [H^-1]_jj^2`` (the OBS
  saliency), and each pruned weight's error spread over the later columns through the
  upper Cholesky factor of the damped inverse Hessian ``H = 2 X^T X / M`` (the same
  accumulator as GPTQ, :class:`~llmserve.compress.gptq.GPTQ`).

``2:4`` (NVIDIA's semi-structured sparsity): in every group of 4 consecutive weights
along the input dimension exactly 2 are zero, so sparsity is 0.5. The calibration pass
is the quantization pipeline's (:mod:`llmserve.compress.pipeline`): one layer's
activations at a time, each layer's input being the pruned previous layer's output.
The result is dense tensors with zeros: on CPU it runs at dense speed (there is no
sparse kernel here); on CUDA with compute capability >= 8.0,
``torch.sparse.to_sparse_semi_structured`` can hold a 2:4 weight (not done by the engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmserve.compress.gptq import GPTQ
from llmserve.compress.pipeline import GROUPS, check_architecture, sequential_layers

METHODS = ("magnitude", "wanda", "sparsegpt")
PATTERNS = ("2:4", "unstructured")


@dataclass
class PruneOptions:
    """``llmserve prune`` settings (validated by :func:`check_options`)."""

    method: str = "wanda"
    pattern: str = "2:4"
    sparsity: float = 0.5
    percdamp: float = 0.01  # SparseGPT damping, as GPTQ's
    block_size: int = 128  # SparseGPT columns per lazy update


def check_options(o: PruneOptions) -> None:
    """Raises ValueError naming the flag: an unknown method or pattern, a sparsity
    outside (0, 1), or 2:4 with a sparsity other than 0.5."""
    if o.method not in METHODS:
        raise ValueError(f"--method must be one of {list(METHODS)}, got {o.method!r}")
    if o.pattern not in PATTERNS:
        raise ValueError(f"--pattern must be one of {list(PATTERNS)}, got {o.pattern!r}")
    if isinstance(o.sparsity, bool) or not 0 < o.sparsity < 1:
        raise ValueError(f"--sparsity must be in (0, 1), got {o.sparsity!r}")
    if o.pattern == "2:4" and o.sparsity != 0.5:
        raise ValueError(f"--sparsity must be 0.5 with --pattern 2:4 (2 of every 4 "
                         f"weights), got {o.sparsity!r}")


def _nm_mask(score: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """True where pruned: the ``n`` lowest scores of every ``m`` consecutive inputs."""
    rows, k = score.shape
    if k % m:
        raise ValueError(f"2:4 needs in_features divisible by {m}, got {k}")
    groups = score.reshape(rows, k // m, m)
    low = torch.topk(groups, n, dim=-1, largest=False).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, low, True)
    return mask.reshape(rows, k)


def score_mask(score: torch.Tensor, pattern: str, sparsity: float,
               per_row: bool) -> torch.Tensor:
    """The pruned positions (True) of a ``[N, K]`` score: 2:4 groups, or the
    ``round(sparsity * count)`` lowest per row (``per_row``) or over the matrix."""
    if pattern == "2:4":
        return _nm_mask(score)
    if per_row:
        k = int(round(sparsity * score.shape[1]))
        low = torch.topk(score, k, dim=1, largest=False).indices
        return torch.zeros_like(score, dtype=torch.bool).scatter_(1, low, True)
    k = int(round(sparsity * score.numel()))
    low = torch.topk(score.flatten(), k, largest=False).indices
    return torch.zeros(score.numel(), dtype=torch.bool).scatter_(0, low, True).view_as(score)


def prune_magnitude(weight: torch.Tensor, pattern: str, sparsity: float) -> torch.Tensor:
    """``weight [N, K]`` with the smallest ``|w|`` zeroed (a new tensor)."""
    return weight.masked_fill(score_mask(weight.abs(), pattern, sparsity, False), 0.0)


def prune_wanda(weight: torch.Tensor, input_sq_sum: torch.Tensor, pattern: str,
                sparsity: float) -> torch.Tensor:
    """Wanda: ``input_sq_sum [K]`` is ``sum over tokens of x_j^2`` (its root is
    ``||X_j||_2``)."""
    score = weight.abs() * input_sq_sum.sqrt()[None, :]
    return weight.masked_fill(score_mask(score, pattern, sparsity, True), 0.0)


def prune_sparsegpt(weight: torch.Tensor, hessian: GPTQ, pattern: str, sparsity: float,
                    percdamp: float = 0.01, block_size: int = 128) -> torch.Tensor:
    """SparseGPT on ``weight [N, K]`` with the accumulated Hessian (a new tensor).

    Raises:
        ValueError: no calibration batch, or a Hessian still singular after damping.
    """
    if hessian.num_samples == 0:
        raise ValueError("SparseGPT needs calibration inputs (add_batch) first")
    W = weight.detach().float().clone()
    n, k = W.shape
    H = hessian.H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(percdamp * torch.mean(torch.diag(H)))
    try:
        U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    except torch.linalg.LinAlgError as e:
        raise ValueError(f"SparseGPT: the damped Hessian is not positive definite ({e}); "
                         "raise percdamp or add calibration data") from None
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        err = torch.zeros_like(W1)
        d = torch.diag(U1)
        if pattern == "unstructured":  # the block's lowest saliencies, over all rows
            mask = score_mask(W1 ** 2 / d[None, :] ** 2, pattern, sparsity, False)
        else:
            mask = torch.zeros_like(W1, dtype=torch.bool)
        for i in range(i2 - i1):
            if pattern == "2:4" and i % 4 == 0:
                sal = W1[:, i:i + 4] ** 2 / d[None, i:i + 4] ** 2
                mask[:, i:i + 4] = _nm_mask(sal)
            w = W1[:, i]
            q = w.masked_fill(mask[:, i], 0.0)
            e = (w - q) / d[i]
            W1[:, i:] -= e[:, None] * U1[i, i:][None, :]
            W1[:, i] = q
            err[:, i] = e
        W[:, i1:i2] = W1
        W[:, i2:] -= err @ U[i1:i2, i2:]
    return W.to(weight.dtype)


def prune_layer(layer: nn.Module, stats: dict[str, Any], o: PruneOptions) -> None:
    """Prune every linear of one decoder layer in place."""
    for names, _ in GROUPS:
        for name in names:
            lin = layer.get_submodule(name)
            w = lin.weight.data
            if o.method == "magnitude":
                new = prune_magnitude(w, o.pattern, o.sparsity)
            elif o.method == "wanda":
                new = prune_wanda(w, stats[names[0]].float(), o.pattern, o.sparsity)
            else:
                new = prune_sparsegpt(w, stats[names[0]], o.pattern, o.sparsity, o.percdamp,
                                      o.block_size)
            lin.weight.data.copy_(new)


@torch.no_grad()
def prune_model(model: nn.Module, o: PruneOptions, calib: torch.Tensor | None,
                progress: bool = True) -> float:
    """Prune every decoder linear of a transformers causal LM (float32) in place;
    returns the fraction of zeros in those linears.

    Args:
        calib: int64 ``[S, L]`` calibration windows (None only for ``magnitude``).

    Raises:
        ValueError: bad options, an unsupported architecture, no calibration data.
    """
    check_options(o)
    check_architecture(model, "prune")
    if calib is None and o.method != "magnitude":
        raise ValueError(f"--method {o.method} needs calibration data")
    record = {"magnitude": None, "wanda": "sqsum", "sparsegpt": "gptq"}[o.method]
    sequential_layers(model, calib, record, lambda _i, layer, stats: prune_layer(layer, stats, o),
                      f"prune {o.method} {o.pattern}", progress)
    return linear_sparsity(model)


def linear_sparsity(model: nn.Module) -> float:
    """Fraction of exact zeros over the decoder linears' weights."""
    zeros = total = 0
    for layer in model.model.layers:
        for names, _ in GROUPS:
            for name in names:
                w = layer.get_submodule(name).weight
                zeros += int((w == 0).sum())
                total += w.numel()
    return zeros / total

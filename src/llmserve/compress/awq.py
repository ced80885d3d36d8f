"""AWQ: activation-aware weight quantization by per-input-channel scales and clipping.

Source: Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration" (MLSys 2024), section 3; reference implementations mit-han-lab/llm-awq,
AutoAWQ and llm-compressor's ``AWQModifier`` (read, not copied).

Linears ``W_i [N_i, K]`` that read the same input ``X [M, K]`` share one scale
``s [K]``; ``W_i diag(s)`` is quantized and ``1/s`` folded into the op that produces
``X`` (an RMSNorm weight or the rows of the previous linear), so the float function is
unchanged. Scale search over ``n_grid`` ratios ``r`` in ``[0, 1)``::

    x_mean[k] = mean_m |X[m, k]|        w_mean[k] = mean_n |W[n, k]| / max_{k' in group} |W[n, k']|
    s(r) = x_mean^r / w_mean^(1-r), normalised by sqrt(max s * min s)
    Y = f(X; W),  Y'(r) = f(X / s; Q(W diag(s)))                   (all the W_i together)
    r* = argmin_r  mean_m ||Y'_m - Y_m||^2 / ||Y_m||^2                (s = 1 also a candidate)

where ``f`` is the parent module (the attention block for q/k/v, the MLP for
gate/up; AutoAWQ's ``module2inspect``) or, for o/down, the linear itself. Each
token's error is taken relative to its own output (ours; AutoAWQ and llm-compressor
use the plain mean squared error): in Qwen2.5 a few tokens carry residual activations
of several hundred (max |x| 324 from layer 6 on), so those tokens' error dominates
the plain mean, and the scales it picked made the model worse than none
(Qwen2.5-Coder-0.5B, group 32, next-token KL to the float model: RTN 0.144,
plain-error scales 0.171, with clipping 0.162; token-relative with clipping 0.134;
docs/compress.md).

Clipping (after scaling, skipped for q/k whose errors the softmax amplifies): per
output row and group the largest ``|w|`` is shrunk by ``1 - i / n_grid`` (``i`` up to
``max_shrink * n_grid``), keeping the bound with the smallest group output error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmserve.compress.quantizer import fake_quantize, resolve_group_size

N_GRID = 20
MAX_ROWS = 4096  # calibration rows (tokens) used by the searches


def _rows(x: torch.Tensor, limit: int) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1]).float()
    if x.shape[0] <= limit:
        return x
    idx = torch.linspace(0, x.shape[0] - 1, limit).long()
    return x[idx]


def search_scales(x: torch.Tensor, weights: list[torch.Tensor], bits: int, group_size: int,
                  n_grid: int = N_GRID,
                  objective: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
                  ) -> torch.Tensor:
    """The AWQ scale ``s [K]`` for linears ``weights`` (each ``[N_i, K]``) reading
    ``x [..., K]`` (see the module doc).

    ``objective(ws)`` returns the output to match when the linears hold ``ws`` (same
    shapes as ``weights``): the parent module's output (AutoAWQ's ``module2inspect``:
    the attention block for q/k/v, the MLP for gate/up), so that an error the softmax
    or the gate amplifies costs what it costs downstream. Default: the linears' own
    outputs ``x W^T``. Besides the grid, the identity ``s = 1`` is a candidate (the
    grid's ``r = 0`` is ``1 / w_mean``, not the identity), so the search never picks a
    scale worse than none on its own objective.
    """
    xs = _rows(x, MAX_ROWS)
    if objective is None:
        def objective(ws: list[torch.Tensor]) -> torch.Tensor:
            return xs @ torch.cat(ws).t()
    w = torch.cat([t.float() for t in weights])  # [sum N_i, K]
    n, k = w.shape
    gs = resolve_group_size(group_size, k)
    x_mean = xs.abs().mean(0)
    wg = w.abs().reshape(n, k // gs, gs)
    w_mean = (wg / wg.amax(-1, keepdim=True).clamp(min=1e-8)).reshape(n, k).mean(0)
    sizes = [t.shape[0] for t in weights]
    ref = objective([t.float() for t in weights])
    ref = ref.reshape(-1, ref.shape[-1])  # [M, N]
    token_weight = 1.0 / ref.pow(2).sum(-1).clamp(min=1e-12)  # [M]
    best_err, best = float("inf"), torch.ones(k)
    candidates = [torch.ones(k)]
    for i in range(n_grid):
        r = i / n_grid
        s = (x_mean.pow(r) / w_mean.clamp(min=1e-4).pow(1 - r)).clamp(min=1e-4)
        candidates.append(s / (s.max() * s.min()).sqrt())
    for s in candidates:
        wq = fake_quantize(w * s, bits, gs) / s
        d2 = (objective(list(wq.split(sizes))).reshape(ref.shape) - ref).pow(2)
        err = float((d2.sum(-1) * token_weight).mean())
        if err < best_err:
            best_err, best = err, s
    return best


def search_clip(x: torch.Tensor, w: torch.Tensor, bits: int, group_size: int,
                n_grid: int = N_GRID, max_shrink: float = 0.5,
                max_rows: int = 512) -> torch.Tensor:
    """Per row and group clip bounds ``[N, G]`` for ``w [N, K]`` reading ``x [..., K]``.

    The group output error over the ``m`` calibration rows is a quadratic form in the
    weight error ``d = Q(clip(w)) - w`` of the group, so it is computed from the group's
    Gram matrix ``C_g = X_g^T X_g / m`` (``[G, gs, gs]``, once) instead of the ``[m, N, G]``
    outputs for every bound::

        mean_m (x_mg . d_ng)^2 = d_ng^T C_g d_ng
    """
    x = _rows(x, max_rows)
    n, k = w.shape
    gs = resolve_group_size(group_size, k)
    g = k // gs
    xg = x.reshape(-1, g, gs).transpose(0, 1)  # [G, m, gs]
    gram = xg.transpose(1, 2) @ xg / xg.shape[1]  # [G, gs, gs]
    wg = w.float().reshape(n, g, gs)  # [N, G, gs]
    amax = wg.abs().amax(-1)  # [N, G]
    best_err = torch.full((n, g), float("inf"))
    best = amax.clone()
    for i in range(int(max_shrink * n_grid)):
        bound = amax * (1 - i / n_grid)
        cw = torch.maximum(torch.minimum(wg, bound[..., None]), -bound[..., None])
        d = (fake_quantize(cw.reshape(n, k), bits, gs).reshape(n, g, gs) - wg).transpose(0, 1)
        err = ((d @ gram) * d).sum(-1).transpose(0, 1)  # [N, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, bound, best)
    return best


def apply_clip(w: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` clamped to ``[-bound, bound]`` per row and group (``bound [N, G]``)."""
    n, k = w.shape
    g = bound.shape[1]
    wg = w.float().reshape(n, g, k // g)
    return torch.maximum(torch.minimum(wg, bound[..., None]), -bound[..., None]).reshape(n, k)

"""GPTQ: quantize a linear layer column by column, compensating each rounding error
with the inverse Hessian of its layer-wise reconstruction loss.

Source: Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers" (ICLR 2023), Algorithm 1; the reference implementations
IST-DASLab/gptq and GPTQModel (read, not copied).

For inputs ``X [M, K]`` the loss ``||W X^T - Q X^T||^2`` has Hessian ``H = 2 X^T X / M``
(accumulated as a running mean over calibration batches). With ``U`` the upper Cholesky
factor of ``(H + damp I)^-1`` (``damp = percdamp * mean(diag H)``)::

    for each block of B columns (lazy batch update):
        for column j in the block:
            q_j   = quant(w_j)                      (group params fixed at the group's first column)
            e_j   = (w_j - q_j) / U[j, j]
            w_{j:} -= e_j U[j, j:]                  (inside the block)
        W[:, after block] -= E_block U[block, after block]

``act_order`` processes columns by decreasing ``diag H``; groups then follow that
order and ``g_idx[k]`` records the group of original column ``k`` (GPTQ ``desc_act``).
"""

from __future__ import annotations

import torch

from llmserve.compress.quantizer import (
    QuantizedLinear,
    check_bits,
    group_params,
    quantize_codes,
    resolve_group_size,
)


class GPTQ:
    """Hessian accumulator and solver for one linear layer with ``in_features`` inputs."""

    def __init__(self, in_features: int) -> None:
        self.in_features = in_features
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.num_samples = 0

    def add_batch(self, x: torch.Tensor) -> None:
        """Accumulate inputs ``x [..., in_features]`` (each row one token)."""
        x = x.reshape(-1, self.in_features).float()
        m = x.shape[0]
        total = self.num_samples + m
        self.H.mul_(self.num_samples / total)
        self.num_samples = total
        x = x * (2.0 / total) ** 0.5
        self.H.addmm_(x.t(), x)

    def quantize(self, weight: torch.Tensor, bits: int, group_size: int,
                 symmetric: bool = False, act_order: bool = False, percdamp: float = 0.01,
                 block_size: int = 128) -> QuantizedLinear:
        """Quantize ``weight [N, K]`` with the accumulated Hessian.

        Raises:
            ValueError: no batch was added, unsupported bits or group size, or a
                Hessian that stays singular after damping.
        """
        check_bits(bits, method="gptq")
        if self.num_samples == 0:
            raise ValueError("GPTQ needs calibration inputs (add_batch) before quantize")
        n, k = weight.shape
        gs = resolve_group_size(group_size, k)
        W = weight.detach().float().clone()
        H = self.H.clone()
        dead = torch.diag(H) == 0
        H[dead, dead] = 1.0
        W[:, dead] = 0.0
        perm = torch.argsort(torch.diag(H), descending=True) if act_order else None
        if perm is not None:
            W, H = W[:, perm], H[perm][:, perm]
        H.diagonal().add_(percdamp * torch.mean(torch.diag(H)))
        try:
            U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)),
                                      upper=True)
        except torch.linalg.LinAlgError as e:
            raise ValueError(f"GPTQ: the damped Hessian is not positive definite ({e}); "
                             "raise percdamp or use more calibration samples") from None
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny sequential ops: thread wake-ups cost 30x (2 cores)
        try:
            codes, scales, zeros = self._solve(W, U, bits, gs, symmetric, block_size)
        finally:
            torch.set_num_threads(threads)
        g_idx = None
        if perm is not None:
            inverse = torch.argsort(perm)
            codes = codes[:, inverse]
            g_idx = (torch.arange(k) // gs)[inverse]  # original column -> its group
        return QuantizedLinear(codes=codes.to(torch.uint8), scales=scales,
                               zeros=zeros.to(torch.int32), bits=bits, group_size=gs,
                               symmetric=symmetric, g_idx=g_idx)

    @staticmethod
    def _solve(W: torch.Tensor, U: torch.Tensor, bits: int, gs: int, symmetric: bool,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The column loop (module doc) on ``W [N, K]`` in place: float codes ``[N, K]``,
        scales and zeros ``[N, K / gs]``."""
        n, k = W.shape
        groups = k // gs
        scales = torch.empty(n, groups)
        zeros = torch.empty(n, groups)
        codes = torch.empty(n, k)
        scale = zero = None
        for i1 in range(0, k, block_size):
            i2 = min(i1 + block_size, k)
            W1 = W[:, i1:i2].clone()
            E1 = torch.zeros_like(W1)
            U1 = U[i1:i2, i1:i2]
            for i in range(i2 - i1):
                col = i1 + i
                if col % gs == 0:  # the group's params from its current (updated) weights
                    ahead = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :gs]
                    scale, zero = group_params(ahead, bits, symmetric)
                    scales[:, col // gs], zeros[:, col // gs] = scale, zero
                w = W1[:, i]
                q = quantize_codes(w[:, None], scale, zero, bits)[:, 0]
                codes[:, col] = q
                err = (w - (q - zero) * scale) / U1[i, i]
                W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
                E1[:, i] = err
            W[:, i2:] -= E1 @ U[i1:i2, i2:]
        return codes, scales, zeros

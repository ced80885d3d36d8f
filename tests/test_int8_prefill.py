"""W8A8 prompt-row GEMM (layers/quantization/int8_prefill.py): error within the
analytical rounding bound of an exact float64 product, batch invariance, edge cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.layers.quantization.int8_prefill import Int8PrefillWeight, hadamard

GEN = torch.Generator().manual_seed(0)


def rand(*shape, outliers: bool = False) -> torch.Tensor:
    t = torch.randn(*shape, generator=GEN)
    if outliers:  # a few large channels, as in LLM activations
        t[:, :3] *= 40
    return t


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x.w - Q(x).Q(w)| <= s_x/2 sum|w| + s_w/2 sum|x| + K s_x s_w / 4, with
    s = row max / 127 (each code off by at most half a step)."""
    sx = x.abs().amax(1, keepdim=True) / 127
    sw = w.abs().amax(1) / 127
    k = x.shape[1]
    return sx / 2 * w.abs().sum(1) + sw / 2 * x.abs().sum(1, keepdim=True) + k * sx * sw / 4


def rotated(t: torch.Tensor, block: int) -> torch.Tensor:
    """``t`` times the normalized block-diagonal Hadamard matrix, in float64."""
    h = hadamard(block).double()
    assert set(h.unique().tolist()) == {-1.0, 1.0}  # a Hadamard matrix: +-1, H H^T = n I
    assert torch.equal(h @ h.T, block * torch.eye(block, dtype=torch.float64))
    h = h / block ** 0.5
    return (t.double().reshape(t.shape[0], -1, block) @ h).reshape(t.shape)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matmul_within_rounding_bound_of_exact_product(dtype, rotate):
    w = rand(48, 768)
    bias = rand(48)
    x = rand(37, 768, outliers=True).to(dtype)
    q = Int8PrefillWeight.from_float(w, rotate)
    assert q.block == (256 if rotate else 1)
    assert q.codes.dtype == torch.int8 and q.codes.abs().max() == 127
    y = q.matmul(x, bias)
    assert y.dtype == dtype and y.shape == (37, 48)
    exact = F.linear(x.double(), w.double(), bias.double())
    out_round = exact.abs() * (2.0**-8 if dtype == torch.bfloat16 else 1e-6)
    # x.w = x'.w' (rotated); the 16-bit grid of the rotation adds max|x| / 65534 sum|w|
    xr, wr = (rotated(x, 256), rotated(w, 256)) if rotate else (x.double(), w.double())
    grid = x.double().abs().amax(1, keepdim=True) / 65534 * w.double().abs().sum(1) \
        if rotate else 0
    tol = rounding_bound(xr, wr) + grid + out_round + 1e-5
    assert ((y.double() - exact).abs() <= tol).all()
    # the bound is not vacuous: without rotation 3 outlier channels flatten the others
    # (~4% mean error); rotated, their energy is spread over the block (~1%)
    rel = ((y.double() - exact).abs().mean() / exact.abs().mean()).item()
    assert rel < (0.015 if rotate else 0.06), rel
    no_bias = F.linear(x.double(), w.double())
    assert ((q.matmul(x).double() - no_bias).abs() <= tol).all()


def test_int8_rows_are_independent_of_the_other_rows():
    """The same row gives the same bits alone, among 2, 17 or 64 other rows (issue 20)."""
    for rotate in (False, True):
        q = Int8PrefillWeight.from_float(rand(96, 512), rotate)
        row = rand(1, 512).bfloat16()
        alone = q.matmul(row)
        for m in (2, 17, 64):
            others = rand(m, 512, outliers=True).bfloat16()
            for at in (0, m // 2):
                batch = torch.cat([others[:at], row, others[at:]])
                assert torch.equal(q.matmul(batch)[at:at + 1], alone), (rotate, m, at)


def test_int8_zero_rows_and_shards():
    w = rand(8, 64)
    w[3] = 0
    q = Int8PrefillWeight.from_float(w, rotate=False)
    assert q.scales[3] == 0 and not q.codes[3].any()
    x = rand(4, 64)
    x[1] = 0
    bias = rand(8)
    y = q.matmul(x, bias)
    assert torch.equal(y[1], bias) and torch.equal(y[:, 3], bias[3].expand(4))
    fused = Int8PrefillWeight.from_rows([w[:5], w[5:]], rotate=False)  # per-row: one call
    assert torch.equal(fused.codes, q.codes) and torch.equal(fused.scales, q.scales)
    assert q.nbytes() == 8 * 64 + 8 * 4
    r = Int8PrefillWeight.from_float(w)  # rotated (block 64): zero rows stay zero
    assert r.block == 64 and torch.equal(r.matmul(x, bias)[1], bias)


def test_int8_weight_validation():
    with pytest.raises(ValueError, match="int8 codes"):
        Int8PrefillWeight(torch.zeros(4, 8), torch.zeros(4))
    with pytest.raises(ValueError, match="scales"):
        Int8PrefillWeight(torch.zeros(4, 8, dtype=torch.int8), torch.zeros(5))

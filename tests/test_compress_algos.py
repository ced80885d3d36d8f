"""GPTQ, AWQ and SmoothQuant against round-to-nearest on one layer with known inputs.

The oracle is the float layer's output ``X W^T``: each method must reconstruct it with a
smaller error than RTN at the same bits and group size (the property each paper
claims), on inputs shaped like LLM activations (correlated channels, a few outlier
channels with large magnitudes).
"""

from __future__ import annotations

import pytest
import torch

from llmserve.compress import awq, smoothquant
from llmserve.compress.gptq import GPTQ
from llmserve.compress.quantizer import fake_quantize, quantize_rtn


def _inputs(m: int = 2048, k: int = 256, outliers: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) * 0.2 + torch.eye(k)
    x = torch.randn(m, k, generator=g) @ mix  # correlated channels
    x[:, :outliers] *= 20.0  # activation outlier channels (LLM.int8(), SmoothQuant fig. 4)
    return x


def _weight(n: int = 192, k: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _err(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return float(((x @ wq.t()) - (x @ w.t())).pow(2).mean())


@pytest.mark.parametrize("bits,group,act_order", [(4, 64, False), (4, 64, True), (8, 128, False),
                                                  (4, -1, False)])
def test_gptq_reconstruction_beats_rtn(bits, group, act_order):
    x, w = _inputs(), _weight()
    gptq = GPTQ(w.shape[1])
    for chunk in x.split(512):  # several batches: the running mean of 2 X^T X / M
        gptq.add_batch(chunk)
    torch.testing.assert_close(gptq.H, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)
    q = gptq.quantize(w, bits, group, act_order=act_order)
    rtn = quantize_rtn(w, bits, group)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) < 2**bits
    if act_order:  # groups follow the Hessian order: g_idx is a permuted group map
        assert q.g_idx is not None and sorted(q.g_idx.tolist()) == sorted(
            rtn.group_index().tolist())
    e_gptq, e_rtn = _err(x, w, q.dequantize()), _err(x, w, rtn.dequantize())
    assert e_gptq < 0.7 * e_rtn, (e_gptq, e_rtn)


def test_rtn_error_is_at_most_half_a_step():
    w = _weight()
    q = quantize_rtn(w, 4, 32)
    step = q.scales[:, q.group_index()]  # [N, K]: each weight's own grid step
    # half a step, plus the float16 rounding of the scale (at most 15 * 2**-11 of a step)
    assert bool(((q.dequantize() - w).abs() <= 0.51 * step).all())


def test_awq_output_error_beats_rtn():
    x, w = _inputs(), _weight()
    s = awq.search_scales(x, [w], 4, 64)
    ws = w * s
    bound = awq.search_clip(x / s, ws, 4, 64)
    wq = quantize_rtn(awq.apply_clip(ws, bound), 4, 64).dequantize() / s
    e_awq = _err(x, w, wq)
    e_rtn = _err(x, w, fake_quantize(w, 4, 64))
    assert e_awq < 0.8 * e_rtn, (e_awq, e_rtn)
    assert float(s[:4].mean()) > float(s[4:].mean())  # salient (outlier) channels scaled up


def test_awq_keeps_weights_that_quantize_exactly():
    """Weights already on the 4-bit grid have no rounding error: any scale but the
    identity adds some, so the search returns s = 1 (the grid's r = 0 is 1 / w_mean,
    not the identity, so without that candidate it could not)."""
    codes = torch.randint(0, 16, (192, 256), generator=torch.Generator().manual_seed(2))
    codes[:, ::64], codes[:, 1::64] = 0, 15  # every group spans the whole grid
    x, w = _inputs(), (codes.float() - 8) / 16  # a power-of-two step: exact in float16
    assert _err(x, w, fake_quantize(w, 4, 64)) == 0
    s = awq.search_scales(x, [w], 4, 64)
    assert torch.equal(s, torch.ones_like(s))


def test_smoothquant_w8a8_error_beats_rtn():
    x, w = _inputs(outliers=6), _weight()
    ref = x @ w.t()
    codes, scale = smoothquant.quantize_int8_per_channel(w)
    e_rtn = float((smoothquant.w8a8_matmul(x, codes, scale) - ref).pow(2).mean())
    s = smoothquant.smoothing_scales(x.abs().amax(0), [w], alpha=0.5)
    codes_s, scale_s = smoothquant.quantize_int8_per_channel(w * s)
    e_sq = float((smoothquant.w8a8_matmul(x / s, codes_s, scale_s) - ref).pow(2).mean())
    assert e_sq < 0.5 * e_rtn, (e_sq, e_rtn)
    with pytest.raises(ValueError, match="alpha"):
        smoothquant.smoothing_scales(x.abs().amax(0), [w], alpha=1.5)


def test_bad_bits_and_group_size():
    w = _weight()
    with pytest.raises(ValueError, match="--bits 3"):
        quantize_rtn(w, 3, 64)
    with pytest.raises(ValueError, match="--group-size 100"):
        quantize_rtn(w, 4, 100)
    with pytest.raises(ValueError, match="calibration"):
        GPTQ(256).quantize(w, 4, 64)

"""The int8-activation kernel ``gguf_matmul_x16`` on the tiles of ``gguf_repack_x16``:
Q4_K / Q6_K with Q8_K activations (cpu_kernels_x16.c, cpu_kernels_vnni.c), Q8_0 / Q5_0
with activations quantized per 32 (cpu_kernels_x16_q32.c).

Oracle: the weights decoded here from the raw block bytes in numpy (K-quants; checked
against ``gguf.quants.dequantize``, llama.cpp's formulas) or by ``gguf.quants`` (Q8_0,
Q5_0), times the kernel's quantized activations (codes * scale, plus the second pass of
an outlier row: the codes of its rounding residual), summed in float64. The kernel's integer block sums are exact, so it
must agree up to float32 rounding of the per-block scale products and sums. The
activation quantization itself is checked against numpy's float32 ops.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tests.test_kernels import kernels, random_gguf_blocks  # noqa: F401 (fixture)

K_QTYPES = ["Q4_K", "Q6_K"]  # Q8_K activations
QTYPES = [*K_QTYPES, "Q8_0", "Q5_0"]  # Q8_0 / Q5_0: activations per 32


@pytest.fixture(scope="module")
def q8k(kernels):  # noqa: F811
    if not kernels.has_q8k_dot:
        pytest.skip("no AVX512-VNNI here: the bf16/fp32 gguf_matmul path runs instead")
    return kernels


def f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16)[..., 0].astype(np.float64)


def decode_blocks(qtype: str, blocks: np.ndarray, k: int) -> np.ndarray:
    """float64 ``[N, K]`` weights from Q4_K / Q6_K bytes (ggml-common.h layouts)."""
    n = blocks.shape[0]
    if qtype == "Q4_K":
        b = blocks.reshape(n, k // 256, 144)
        d, dmin, sc, qs = f16(b[..., 0:2]), f16(b[..., 2:4]), b[..., 4:16].astype(np.int64), \
            b[..., 16:].astype(np.int64)
        s = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)],
                           -1)
        m = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)],
                           -1)
        qs = qs.reshape(n, k // 256, 4, 32)  # group j reads qs[j // 2], low nibble if j even
        q = np.stack([qs & 15, qs >> 4], -2).reshape(n, k // 256, 8, 32)
        w = d[..., None, None] * s[..., None] * q - dmin[..., None, None] * m[..., None]
    else:
        b = blocks.reshape(n, k // 256, 210)
        ql, qh = b[..., :128].astype(np.int64), b[..., 128:192].astype(np.int64)
        sc, d = b[..., 192:208].view(np.int8).astype(np.int64), f16(b[..., 208:210])
        q = np.empty((n, k // 256, 256), np.int64)
        for h in range(2):
            lo, hi = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
            base = 128 * h
            q[..., base:base + 32] = (lo[..., :32] & 15) | ((hi & 3) << 4)
            q[..., base + 32:base + 64] = (lo[..., 32:] & 15) | (((hi >> 2) & 3) << 4)
            q[..., base + 64:base + 96] = (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4)
            q[..., base + 96:base + 128] = (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)
        w = d[..., None, None] * sc.reshape(n, k // 256, 16, 1) * \
            (q.reshape(n, k // 256, 16, 16) - 32)
    return w.reshape(n, k)


OUTLIER_RATIO = 32  # a row whose 256-span max |x| exceeds this times its mean |x|: 2 passes


def quantize_per_32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q8_0 / Q5_0 activations: int8 codes and float32 scales per 32 (float32 ops)."""
    xb = x.float().view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    iscale = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    codes = torch.clamp(torch.round(xb * iscale), -127, 127)
    scales = torch.where(iscale > 0, 1 / iscale, torch.zeros(()))
    return codes.view(x.shape).to(torch.int8), scales[..., 0]


def dequantized_activations(q8k, qtype: str, x: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, K]``: what the kernel multiplies, int8 codes * scales (per 256 for the
    K-quants, per 32 for Q8_0 / Q5_0), plus for an outlier row the codes of its float32
    rounding residual."""
    m, k = x.shape
    per = 256 if qtype in K_QTYPES else 32
    quantize = q8k.q8k_quantize if per == 256 else quantize_per_32
    codes, scales = quantize(x)
    first = (codes.float().view(m, -1, per) * scales[..., None]).view(m, k)
    xq = first.double()
    for i in range(m):
        spans = x[i].float().abs().split(256)
        if not any(s.amax() > OUTLIER_RATIO * (s.sum() / s.numel()) for s in spans):
            continue
        c2, s2 = quantize((x[i:i + 1].float() - first[i:i + 1]).contiguous())
        xq[i] += (c2.double().view(-1, per) * s2.double()[0, :, None]).view(k)
    return xq


def weights(qtype: str, blocks: np.ndarray, k: int) -> np.ndarray:
    if qtype in K_QTYPES:
        return decode_blocks(qtype, blocks, k)
    return dequantize(blocks, GGMLQuantizationType[qtype]).reshape(-1, k).astype(np.float64)


def x16(q8k, qtype, x, blocks, threads=2, out=None):
    """``gguf_matmul_x16`` on the tiles of ``blocks`` (numpy or torch, the file's bytes)."""
    w = torch.as_tensor(blocks)
    return q8k.gguf_matmul_x16(qtype, x, q8k.gguf_repack_x16(qtype, w), w.shape[0], threads,
                               out)


def reference(q8k, qtype, x, blocks, k):
    xq = dequantized_activations(q8k, qtype, x)
    w = torch.from_numpy(weights(qtype, blocks, k))
    return xq @ w.t(), xq.abs() @ w.abs().t()


@pytest.mark.parametrize("qtype", K_QTYPES)
def test_decoder_matches_gguf_quants(qtype):
    blocks = random_gguf_blocks(qtype, 8, 512, seed=3)
    ref = dequantize(blocks, GGMLQuantizationType[qtype]).reshape(8, 512).astype(np.float64)
    np.testing.assert_allclose(decode_blocks(qtype, blocks, 512), ref, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_is_q8_k(q8k, dtype):
    x = torch.randn(3, 512).to(dtype)
    x[1, :256] = 0  # an all-zero block: scale 0, codes 0
    codes, scales = q8k.q8k_quantize(x)
    xf = x.float().numpy().reshape(3, 2, 256)
    amax = np.abs(xf).max(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32)
    ref = np.clip(np.rint(xf * iscale), -127, 127).astype(np.int8).reshape(3, 512)
    assert np.array_equal(codes.numpy(), ref)
    with np.errstate(divide="ignore"):
        d = np.where(iscale > 0, np.float32(1) / iscale, 0).astype(np.float32)
    assert np.array_equal(scales.numpy(), d[..., 0])


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_of_quantized_activations(q8k, qtype, dtype):
    n = 40  # two whole tiles of 16 rows and one padded
    k = 1024 if qtype in K_QTYPES else 896  # 896: Qwen2.5-0.5B's hidden size, 3.5 x 256
    blocks = random_gguf_blocks(qtype, n, k, seed=1)
    for m in (1, 3, 4, 5, 6, 7, 16):  # row tiles of 1..3 and 4: 4 + 1, 4 + 3, 4 x 4
        x = (torch.randn(m, k) * torch.rand(m, 1) * 4).to(dtype)
        x[0, 5] = 30.0  # an outlier: coarse codes in its block, exact sums all the same
        x[-1, 300] = 1e4  # a massive activation: this row takes the second pass
        ref, mag = reference(q8k, qtype, x, blocks, k)
        got = x16(q8k, qtype, x, blocks).double()
        tol = mag * 2e-6 + (ref.abs() * 2**-8 if dtype == torch.bfloat16 else 0)
        assert ((got - ref).abs() <= tol + 1e-30).all(), (got - ref).abs().max()


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_do_not_depend_on_the_batch(q8k, qtype):
    """Batch invariance (issue 20): a row's bits are the same alone, in any M, any
    position, and with 1 or 2 threads."""
    n, k = 96, 768
    w = random_gguf_blocks(qtype, n, k, seed=2)
    x = torch.randn(16, k)
    x[3, 10] = x[8, 700] = 500.0  # rows with a second pass among rows without
    x = x.bfloat16()
    alone = torch.cat([x16(q8k, qtype, x[i:i + 1], w, 1) for i in range(16)])
    for m in (2, 5, 6, 7, 8, 16):
        got = x16(q8k, qtype, x[:m], w, 2)
        assert torch.equal(got, alone[:m])
    flipped = x16(q8k, qtype, x.flip(0)[:8], w, 2)
    assert torch.equal(flipped, alone.flip(0)[:8])


@pytest.mark.parametrize("qtype", QTYPES)
def test_second_pass_keeps_massive_activation_rows_precise(q8k, qtype):
    """A lone massive activation (Qwen2's first token: up to 240x a block's mean) leaves
    Q8_K one code for most of its block; the second pass brings the row back to about
    the float32 product of the unquantized x, as close as rows without outliers."""
    n, k = 64, 1024
    blocks = random_gguf_blocks(qtype, n, k, seed=4)
    w = torch.from_numpy(weights(qtype, blocks, k))
    x = torch.randn(2, k)
    x[1, 17] = 240 * x[1, :256].abs().mean()
    exact = x.double() @ w.t()
    err = (x16(q8k, qtype, x, blocks).double() - exact).abs().amax(-1) / exact.abs().amax(-1)
    per = 256 if qtype in K_QTYPES else 32  # one pass alone, as llama.cpp: far off on row 1
    codes, scales = (q8k.q8k_quantize if per == 256 else quantize_per_32)(x)
    one_pass = (codes.double().view(2, -1, per) * scales.double()[..., None]).view(2, k) @ w.t()
    err_one = (one_pass - exact).abs().amax(-1) / exact.abs().amax(-1)
    assert err[1] < 2 * err[0] + 1e-6 and err_one[1] > 20 * err[1], (err, err_one)


def test_repack_pads_rows_and_rejects_bad_input(q8k):
    w = torch.from_numpy(random_gguf_blocks("Q4_K", 17, 512))
    tiles = q8k.gguf_repack_x16("Q4_K", w)
    assert tiles.shape == (2, 2 * 2368) and not tiles[1].view(2, 2368)[:, 2:32].any()
    with pytest.raises(ValueError, match="gguf_repack_x16"):
        q8k.gguf_repack_x16("Q5_K", w)
    with pytest.raises(ValueError, match="gguf_repack_x16"):
        q8k.gguf_repack_x16("Q4_K", w[:, :100])
    with pytest.raises(ValueError, match="gguf_matmul_x16"):
        q8k.gguf_matmul_x16("Q4_K", torch.randn(1, 512), tiles, 40)


def test_out_argument_and_bad_input(q8k):
    k, n = 512, 24
    w = torch.from_numpy(random_gguf_blocks("Q6_K", n, k))
    tiles = q8k.gguf_repack_x16("Q6_K", w)
    x = torch.randn(3, k)
    out = torch.zeros(3, n + 8)
    q8k.gguf_matmul_x16("Q6_K", x, tiles, n, 2, out=out[:, 4:4 + n])
    assert torch.equal(out[:, 4:4 + n], q8k.gguf_matmul_x16("Q6_K", x, tiles, n, 1))
    assert not out[:, :4].any() and not out[:, 4 + n:].any()
    with pytest.raises(ValueError, match="gguf_matmul_x16"):
        q8k.gguf_matmul_x16("Q5_K", x, tiles, n)
    with pytest.raises(ValueError, match="gguf_matmul_x16"):
        q8k.gguf_matmul_x16("Q6_K", torch.randn(17, k), tiles, n)
    with pytest.raises(ValueError, match="gguf_matmul_x16"):
        q8k.gguf_matmul_x16("Q6_K", torch.randn(2, 256), tiles, n)
    with pytest.raises(ValueError, match="q8k_quantize"):
        q8k.q8k_quantize(torch.randn(2, 100))


def f16_bytes(v: float) -> np.ndarray:
    return np.array([v], np.float16).view(np.uint8)


def extreme_blocks(qtype: str, n: int, k: int) -> np.ndarray:
    """Saturating hand-made blocks: every code at its maximum (or 0 / alternating), every
    scale and min at its extreme (Q4_K 6-bit 63 / 0, Q6_K int8 -128 / 127 / -1 / 0)."""
    nb, bb = k // 256, (144 if qtype == "Q4_K" else 210)
    b = np.zeros((n, nb, bb), np.uint8)
    code_bytes = [0xFF, 0x00, 0x0F, 0xF0, 0xAA, 0x55]
    for r in range(n):
        for j in range(nb):
            c = code_bytes[(r + j) % len(code_bytes)]
            if qtype == "Q4_K":
                b[r, j, 0:2] = f16_bytes([1.0, 0.5][r % 2])
                b[r, j, 2:4] = f16_bytes([0.25, 2.0][j % 2])
                b[r, j, 4:16] = [0xFF, 0x00, 0x3F, 0xC0][(r // 2 + j) % 4]  # scales / mins
                b[r, j, 16:] = c
            else:
                b[r, j, :192] = c
                sc = np.array([-128, 127, -1, 0] * 4, np.int8)
                b[r, j, 192:208] = np.roll(sc, r + j).view(np.uint8)
                b[r, j, 208:210] = f16_bytes([1.0, -0.5][r % 2])
    return b.reshape(n, -1)


@pytest.mark.parametrize("qtype", K_QTYPES)
def test_extreme_codes_scales_and_activations(q8k, qtype):
    """No saturation or overflow: maximal codes x maximal scales x activations quantized
    to +-127 everywhere (VPMADDUBSW pairs, VPDPWSSD lanes, bsums at their bounds)."""
    n, k = 24, 1024
    blocks = extreme_blocks(qtype, n, k)
    ones = torch.ones(k)
    alt = torch.tensor([1.0, -1.0]).repeat(k // 2)
    x = torch.stack([ones, -ones, alt, -alt, ones * 1e-3, torch.where(torch.arange(k) % 256 == 7,
                     1000.0, -1.0), (torch.arange(k) % 255 - 127.0) / 127])
    ref, mag = reference(q8k, qtype, x, blocks, k)
    got = x16(q8k, qtype, x, blocks).double()
    assert mag.max() > 1e4  # the sums are large: an int16 wrap would show
    assert ((got - ref).abs() <= mag * 2e-6 + 1e-30).all(), (got - ref).abs().max()

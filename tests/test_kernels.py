"""The C kernels of llmserve.kernels against the PyTorch code they replace (the oracle).

Elementwise kernels (RoPE, SwiGLU, residual add) emulate PyTorch's bfloat16 rounding
and must match it bit for bit; reductions (RMSNorm's mean, attention) may differ in
summation order only, so they get tolerances of one rounding step.
"""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmserve.kernels import build_cpu_kernels, get_cpu_kernels
from llmserve.kernels.cpu import CpuKernels
from llmserve.layers.activation import SiluAndMul
from llmserve.layers.rotary_embedding import apply_rotary_emb

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the layers run their PyTorch code")
    k = get_cpu_kernels()
    assert k is not None, "a C compiler is present, yet the kernels did not build"
    return k


def torch_rms_norm(x, weight, eps, residual=None):
    """What llmserve.layers.layernorm.RMSNorm computes without kernels (HF LlamaRMSNorm)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(kernels, dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(13, 576, generator=gen) * 3).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    residual = torch.randn(13, 576, generator=gen).to(dtype) if with_residual else None
    got = kernels.rms_norm(x, weight, 1e-5, residual)
    want = torch_rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the residual sum is elementwise: exact
        got, want = got[0], want[0]
    # the mean of squares is summed in another order: one rounding step at most
    tol = dict(atol=0, rtol=2 ** -7) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, want, **tol)
    assert got.dtype == dtype and got.shape == x.shape


def test_rms_norm_strided_rows_and_errors(kernels):
    base = torch.randn(4, 1000)
    x = base[:, :576]  # rows with stride 1000
    weight = torch.randn(576)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6),
                               torch_rms_norm(x, weight, 1e-6), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="rms_norm"):
        kernels.rms_norm(x, torch.randn(10), 1e-6)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.rms_norm(x.half(), weight.half(), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_emb_in_place_on_a_strided_view(kernels, dtype):
    gen = torch.Generator().manual_seed(1)
    num_tokens, heads, kv_heads, head_dim = 6, 9, 3, 64
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    cos = torch.randn(num_tokens, 1, head_dim // 2, generator=gen).to(dtype)
    sin = torch.randn(num_tokens, 1, head_dim // 2, generator=gen).to(dtype)
    view = qkv.view(num_tokens, -1, head_dim)
    want = apply_rotary_emb(view[:, :heads + kv_heads], cos, sin)
    untouched = view[:, heads + kv_heads:].clone()
    kernels.rotary_emb_(view[:, :heads + kv_heads], cos, sin)
    assert torch.equal(view[:, :heads + kv_heads], want)  # same rounding, bit for bit
    assert torch.equal(view[:, heads + kv_heads:], untouched)  # value heads left alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(kernels, dtype):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(33, 2 * 1536, generator=gen) * 6).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp under/overflow, signed zero
    got = kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)  # float32 silu is within 2 ulp; rounded, identical
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(SiluAndMul()(x), want, atol=1e-6, rtol=1e-6)


def test_write_kv_and_bad_slots(kernels):
    num_blocks, block_size, kv_heads, head_dim = 5, 4, 3, 16
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    qkv = torch.randn(3, (6 + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    heads = qkv.view(3, -1, head_dim)
    key, value = heads[:, 6:6 + kv_heads], heads[:, 6 + kv_heads:]
    slots = torch.tensor([17, -1, 2])  # -1: a padding token, not written
    kernels.write_kv(key, value, key_cache, value_cache, slots)
    flat_k = key_cache.view(-1, kv_heads, head_dim)
    flat_v = value_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[17], key[0]) and torch.equal(flat_v[2], value[2])
    assert int((flat_k != 0).any(-1).any(-1).sum()) == 2
    with pytest.raises(ValueError, match="outside the KV cache"):
        kernels.write_kv(key, value, key_cache, value_cache, torch.tensor([0, 1, 20]))


def dense_decode_attention(query, key_cache, value_cache, block_table, seq_lens, scale,
                           window):
    """float32 softmax(q k^T) v over each sequence's gathered context."""
    outs = []
    num_kv_heads = key_cache.shape[2]
    for s, length in enumerate(seq_lens.tolist()):
        k = key_cache[block_table[s]].reshape(-1, num_kv_heads, key_cache.shape[3])[:length]
        v = value_cache[block_table[s]].reshape(-1, num_kv_heads, key_cache.shape[3])[:length]
        if window:
            k, v = k[max(0, length - window):], v[max(0, length - window):]
        group = query.shape[1] // num_kv_heads
        k = k.float().repeat_interleave(group, 1)  # [ctx, H, D]
        v = v.float().repeat_interleave(group, 1)
        probs = torch.softmax(torch.einsum("hd,khd->hk", query[s].float(), k) * scale, -1)
        outs.append(torch.einsum("hk,khd->hd", probs, v))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 8, 128), (4, 2, 80), (6, 1, 16)])
@pytest.mark.parametrize("window", [None, 7])
def test_paged_attention_decode(kernels, dtype, heads, window):
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(num_heads * head_dim)
    block_size, num_blocks = 4, 40
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim,
                            generator=gen).to(dtype)
    value_cache = torch.randn(key_cache.shape, generator=gen).to(dtype)
    seq_lens = torch.tensor([1, 5, 4, 23, 9])
    block_table = torch.stack([torch.randperm(num_blocks - 1, generator=gen)[:6] + 1
                               for _ in seq_lens])
    # queries as the rows of a fused qkv output (strided)
    qkv = torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head_dim,
                      generator=gen).to(dtype)
    query = qkv.view(len(seq_lens), -1, head_dim)[:, :num_heads]
    got = kernels.paged_attention_decode(query, key_cache, value_cache, block_table,
                                         seq_lens, head_dim ** -0.5, window)
    want = dense_decode_attention(query, key_cache, value_cache, block_table, seq_lens,
                                  head_dim ** -0.5, window)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: the output's rounding
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_paged_attention_decode_threads_and_errors(kernels):
    """Enough work to be split over threads: the result must not depend on it."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size = 1100, 16
    key_cache = torch.randn(num_blocks, block_size, 3, 64, generator=gen).to(torch.bfloat16)
    value_cache = torch.randn(key_cache.shape, generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor([2048, 1500, 700, 2000, 33, 1999, 2048, 1024])
    block_table = torch.randint(1, num_blocks, (8, 128), generator=gen)
    query = torch.randn(8, 9, 64, generator=gen).to(torch.bfloat16)
    one = kernels.paged_attention_decode(query, key_cache, value_cache, block_table, seq_lens,
                                         0.125, None, num_threads=1)
    four = kernels.paged_attention_decode(query, key_cache, value_cache, block_table,
                                          seq_lens, 0.125, None, num_threads=4)
    assert torch.equal(one, four)
    want = dense_decode_attention(query, key_cache, value_cache, block_table, seq_lens, 0.125,
                                  None)
    torch.testing.assert_close(one.float(), want, atol=1e-2, rtol=1e-2)
    bad = block_table.clone()
    bad[3, 0] = num_blocks
    with pytest.raises(ValueError, match="outside the KV cache"):
        kernels.paged_attention_decode(query, key_cache, value_cache, bad, seq_lens, 0.125)
    with pytest.raises(ValueError, match="longer than its block table"):
        kernels.paged_attention_decode(query, key_cache, value_cache, block_table[:, :10],
                                       seq_lens, 0.125)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 1300])
def test_split_k_spans_match_dense_and_do_not_depend_on_the_batch(kernels, dtype, window):
    """Sequences longer than a 512-position span run split-K (flash-decoding): every span
    on its own thread, combined by log-sum-exp. The result equals dense attention, and a
    sequence's output is bit for bit the same alone, batched, or on any thread count."""
    gen = torch.Generator().manual_seed(11)
    num_blocks, block_size = 700, 16
    key_cache = torch.randn(num_blocks, block_size, 3, 64, generator=gen).to(dtype)
    value_cache = torch.randn(key_cache.shape, generator=gen).to(dtype)
    # lengths around the span edges: 1 span, exactly 2, 2 + 1 position, 8 spans + a tail
    seq_lens = torch.tensor([512, 1024, 1025, 4100, 7])
    block_table = torch.stack([torch.randperm(num_blocks - 1, generator=gen)[:260] + 1
                               for _ in seq_lens])
    # peaked scores: the combine's rescaling between spans must be right, not averaged away
    query = (torch.randn(len(seq_lens), 9, 64, generator=gen) * 3).to(dtype)
    got = kernels.paged_attention_decode(query, key_cache, value_cache, block_table,
                                         seq_lens, 0.125, window, num_threads=2)
    want = dense_decode_attention(query, key_cache, value_cache, block_table, seq_lens, 0.125,
                                  window)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    for s in range(len(seq_lens)):
        for threads in (1, 3):
            alone = kernels.paged_attention_decode(
                query[s:s + 1], key_cache, value_cache, block_table[s:s + 1],
                seq_lens[s:s + 1], 0.125, window, num_threads=threads)
            assert torch.equal(alone[0], got[s]), (s, threads)


def test_portable_build_matches(kernels, tmp_path):
    """The C fallback for CPUs without AVX-512 (same source, no -march=native)."""
    with open("/proc/cpuinfo") as f:
        if "avx512f" not in f.read():
            pytest.skip("this CPU runs the portable code already")

    path = build_cpu_kernels(cache_dir=str(tmp_path), native=False)
    portable = CpuKernels(ctypes.CDLL(path))
    gen = torch.Generator().manual_seed(9)
    key_cache = torch.randn(30, 4, 3, 64, generator=gen).to(torch.bfloat16)
    value_cache = torch.randn(key_cache.shape, generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor([3, 50, 17])
    block_table = torch.stack([torch.randperm(29, generator=gen)[:13] + 1 for _ in range(3)])
    query = torch.randn(3, 9, 64, generator=gen).to(torch.bfloat16)
    args = (query, key_cache, value_cache, block_table, seq_lens, 0.125, 9)
    torch.testing.assert_close(portable.paged_attention_decode(*args).float(),
                               kernels.paged_attention_decode(*args).float(),
                               atol=1e-2, rtol=1e-2)
    x = (torch.randn(5, 3072, generator=gen) * 5).to(torch.bfloat16)
    assert torch.equal(portable.silu_and_mul(x), kernels.silu_and_mul(x))


def test_build_errors_and_opt_out(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with pytest.raises(RuntimeError, match="could not compile"):
        build_cpu_kernels(cache_dir=str(tmp_path))
    get_cpu_kernels.cache_clear()
    try:
        assert get_cpu_kernels() is None  # a warning, and the layers use PyTorch
        monkeypatch.delenv("CC")
        monkeypatch.setenv("LLMSERVE_CPU_KERNELS", "0")
        get_cpu_kernels.cache_clear()
        assert get_cpu_kernels() is None
    finally:
        monkeypatch.delenv("LLMSERVE_CPU_KERNELS", raising=False)
        get_cpu_kernels.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 16])
def test_q8_0_matmul_matches_the_gguf_formula(kernels, dtype, num_rows):
    """y = x (d q)^T with d the fp16 block scale: every product exact in float32."""
    gen = torch.Generator().manual_seed(num_rows)
    n, k = 70, 96  # 3 blocks of 32 per row
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
    x = torch.randn(num_rows, k, generator=gen).to(dtype)
    weight = (codes.float().view(n, k // 32, 32) * scales[:, :, None]).view(n, k)
    want = x.double() @ weight.double().T
    got = kernels.q8_0_matmul(x, codes, scales, num_threads=2)
    assert got.dtype == dtype and got.shape == (num_rows, n)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5  # bf16: the output's rounding
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=tol)
    with pytest.raises(ValueError, match="q8_0_matmul"):
        kernels.q8_0_matmul(torch.randn(17, k).to(dtype), codes, scales)


# ---------------------------------------------------------------- GGUF block matmul
# (ggml type, byte offsets of the fp16 fields) per type; every other byte is random
GGUF_FP16_FIELDS = {"Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_gguf_blocks(qtype: str, rows: int, cols: int, seed: int = 0,
                       scale: float = 0.02) -> np.ndarray:
    """uint8 ``[rows, bytes per row]``: random codes, scales and high bits (every bit
    pattern a file may hold), finite fp16 scales of both signs incl. a subnormal and 0."""
    from llmserve.kernels.cpu import GGUF_MATMUL_TYPES

    _, qb, bb = GGUF_MATMUL_TYPES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // qb, bb), dtype=np.uint8)
    for off in GGUF_FP16_FIELDS[qtype]:
        d = (rng.standard_normal((rows, cols // qb)) * scale).astype(np.float16)
        d.flat[0], d.flat[-1] = np.float16(3e-6), np.float16(0)  # subnormal, zero
        b[..., off:off + 2] = d.view(np.uint8).reshape(rows, cols // qb, 2)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(GGUF_FP16_FIELDS))
def test_gguf_matmul_dequantizes_like_gguf_quants(kernels, qtype):
    """x = one-hot rows: the kernel returns its float32 weights, which must equal
    gguf.quants.dequantize (llama.cpp's reference formulas) value for value."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n, k = 24, 512
    blocks = random_gguf_blocks(qtype, n, k)
    ref = dequantize(blocks, GGMLQuantizationType[qtype]).reshape(n, k).astype(np.float32)
    eye = torch.eye(k)
    got = torch.cat([kernels.gguf_matmul(qtype, eye[i:i + 16], torch.from_numpy(blocks), 2)
                     for i in range(0, k, 16)]).t()
    assert np.array_equal(got.numpy(), ref)  # float equality (+0 and -0 alike)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", list(GGUF_FP16_FIELDS))
def test_gguf_matmul_matches_float64_product(kernels, qtype, dtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n, k = 40, 768
    blocks = torch.from_numpy(random_gguf_blocks(qtype, n, k, seed=1))
    weight = torch.from_numpy(
        dequantize(blocks.numpy(), GGMLQuantizationType[qtype]).reshape(n, k).astype(np.float64))
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 3, 16):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        want = x.double() @ weight.T
        out = torch.zeros(rows, n + 8, dtype=dtype)  # a column slice: strided rows
        got = kernels.gguf_matmul(qtype, x, blocks, 2, out=out[:, 4:4 + n])
        assert got.data_ptr() == out[:, 4].data_ptr() and not out[:, :4].any()
        tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(),
                                   rtol=tol)
    with pytest.raises(ValueError, match="gguf_matmul"):
        kernels.gguf_matmul(qtype, torch.randn(17, k).to(dtype), blocks)
    with pytest.raises(ValueError, match="gguf_matmul"):
        kernels.gguf_matmul(qtype, torch.randn(2, k - 32).to(dtype), blocks)
    with pytest.raises(ValueError, match="gguf_matmul"):
        kernels.gguf_matmul("Q2_K", torch.randn(2, k).to(dtype), blocks)

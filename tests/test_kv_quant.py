"""Quantized KV pages (issue 15 item 1): ``--kv-cache-dtype int8|fp8_e4m3``.

Oracles: the PyTorch reference quantize / dequantize of ``layers/attention/kv_quant.py``
(``torch.round`` and ``torch.float8_e4m3fn``: the C kernels must produce the same bytes)
and float32 softmax attention in PyTorch over the reference-dequantized K/V; for the
engine, the same engine at full-precision KV (greedy agreement, measured and bounded) and
at the same KV dtype without prefix caching, preemption or the shared store (exact).
"""

from __future__ import annotations

import pytest
import torch

from llmserve import SamplingParams
from llmserve.config import CacheConfig
from llmserve.kernels import get_cpu_kernels
from llmserve.layers.attention import (
    CommonAttentionMetadata,
    CpuAttentionBackend,
    ReferenceAttentionBackend,
)
from llmserve.layers.attention import cpu as cpu_backend_module
from llmserve.layers.attention.kv_quant import QUANT_STORAGE, dequantize_kv, quantize_kv
from tests.conftest import engine_variant

FORMATS = ["int8", "fp8_e4m3"]
needs_kernels = pytest.mark.skipif(get_cpu_kernels() is None, reason="no C compiler")


def _rows(num_tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows over 10 decades of magnitude, one all-zero token, one outlier channel."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, heads, head_dim, generator=g)
    x *= torch.logspace(-6, 4, num_tokens)[:, None, None]
    x[1] = 0
    x[2, :, 5] = 300.0
    return x.to(dtype)


# ---------------------------------------------------------------- kernels vs PyTorch
@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kernel_stores_the_reference_quantized_bytes(fmt, dtype):
    k = get_cpu_kernels()
    T, H, D, num_blocks, bs = 41, 3, 64, 8, 16
    key, value = _rows(T, H, D, dtype), _rows(T, H, D, dtype).flip(0)
    key_cache = torch.zeros(num_blocks, bs, H, D + 2, dtype=QUANT_STORAGE[fmt])
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(num_blocks * bs, generator=torch.Generator().manual_seed(1))[:T]
    slots[7] = -1  # padding: skipped
    k.write_kv_quant(fmt, key, value, key_cache, value_cache, slots)
    keep = slots >= 0
    for cache, x in ((key_cache, key), (value_cache, value)):
        stored = cache.view(-1, H, D + 2)[slots[keep]]
        assert torch.equal(stored, quantize_kv(x[keep], fmt))  # codes and fp16 scales
        # and the reference dequantization is close to the input: half a step of the
        # row's grid (int8) / 2^-4 relative (e4m3), where the scale is a normal fp16
        qmax = 127 if fmt == "int8" else 448
        err = (dequantize_kv(stored) - x[keep].float()).abs().amax(-1)
        amax = x[keep].float().abs().amax(-1)
        normal = amax / qmax >= 2.0 ** -14
        bound = amax * (0.5 / 127 if fmt == "int8" else 1 / 16) * 1.01
        assert normal.sum() > 60 and torch.all(err[normal] <= bound[normal])
    assert not cache.view(-1, H, D + 2)[~torch.isin(torch.arange(num_blocks * bs),
                                                    slots)].any()


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim,window", [(64, None), (48, 20)])
def test_decode_kernel_equals_torch_attention_over_dequantized_kv(fmt, head_dim, window):
    k = get_cpu_kernels()
    g = torch.Generator().manual_seed(2)
    H, Hkv, bs, num_blocks = 9, 3, 16, 40
    key_cache = quantize_kv(torch.randn(num_blocks, bs, Hkv, head_dim, generator=g) * 3, fmt)
    value_cache = quantize_kv(torch.randn(num_blocks, bs, Hkv, head_dim, generator=g), fmt)
    seq_lens = torch.tensor([1, 16, 17, 70, 128])
    block_table = torch.stack([torch.randperm(num_blocks - 1, generator=g)[:8] + 1
                               for _ in seq_lens])
    query = torch.randn(len(seq_lens), H, head_dim, generator=g)
    scale = head_dim ** -0.5
    out = k.paged_attention_decode_quant(fmt, query, key_cache, value_cache, block_table,
                                         seq_lens, scale, window, 2)
    keys, values = dequantize_kv(key_cache), dequantize_kv(value_cache)
    for s, n in enumerate(seq_lens.tolist()):
        kk = keys[block_table[s]].flatten(0, 1)[:n].repeat_interleave(H // Hkv, 1)
        vv = values[block_table[s]].flatten(0, 1)[:n].repeat_interleave(H // Hkv, 1)
        scores = torch.einsum("hd,khd->hk", query[s], kk) * scale
        if window is not None:
            scores[:, :max(0, n - window)] = float("-inf")
        want = torch.einsum("hk,khd->hd", scores.softmax(-1), vv)
        torch.testing.assert_close(out[s], want, rtol=1e-5, atol=2e-6)


def _mixed_step(block_size: int):
    """Two decodes, then a prompt chunk with 21 earlier tokens in the cache and a fresh
    prompt: (metadata, earlier positions to fill per sequence)."""
    query_lens, seq_lens = [1, 1, 19, 37], [30, 5, 40, 37]
    tables = [[3, 9], [5], [1, 7, 11], [2, 4, 6]]
    return CommonAttentionMetadata.from_lists(query_lens, seq_lens, tables, block_size)


@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernels", "torch-fallback"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_backend_on_quantized_pages_equals_reference_backend(fmt, kernels, monkeypatch):
    if kernels and get_cpu_kernels() is None:
        pytest.skip("no C compiler")
    if not kernels:  # the PyTorch paths: gather + dequantize, torch quantize on write
        import llmserve.layers.attention.backend as backend_module

        monkeypatch.setattr(cpu_backend_module, "get_cpu_kernels", lambda: None)
        monkeypatch.setattr(backend_module, "get_cpu_kernels", lambda: None)
    g = torch.Generator().manual_seed(3)
    H, Hkv, D, bs = 9, 3, 64, 16
    md = _mixed_step(bs)
    key_cache = quantize_kv(torch.randn(12, bs, Hkv, D, generator=g), fmt)  # earlier KV
    value_cache = quantize_kv(torch.randn(12, bs, Hkv, D, generator=g), fmt)
    T = md.num_tokens
    query, key, value = (torch.randn(T, n, D, generator=g) for n in (H, Hkv, Hkv))
    ref_caches = key_cache.clone(), value_cache.clone()
    ours = CpuAttentionBackend(H, D, Hkv, D ** -0.5)
    out = ours.forward(query, key, value, key_cache, value_cache,
                       CpuAttentionBackend.build_metadata(md))
    want = ReferenceAttentionBackend(H, D, Hkv, D ** -0.5).forward(
        query, key, value, *ref_caches, md)
    assert torch.equal(key_cache, ref_caches[0]) and torch.equal(value_cache, ref_caches[1])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_bad_kv_cache_dtype_is_a_clear_error_and_fp8_is_an_alias():
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert CacheConfig(kv_cache_dtype="INT8").kv_cache_dtype == "int8"
    for bad in ("int4", "fp8_e5m2", "", None, 8):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16"):
            CacheConfig(kv_cache_dtype=bad)


# ---------------------------------------------------------------- the engine
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three colors:", "Explain photosynthesis in one sentence.",
           "Translate 'good morning' into Spanish.", "What is 12 times 12?",
           "Once upon a time, in a small village,"]
MAX_TOKENS = 24


def _greedy(n: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    """Share of tokens before each sequence's first divergence (greedy prefix agreement)."""
    same = 0
    for a, b in zip(ref, got, strict=True):
        n = 0
        while n < len(a) and a[n] == b[n]:
            n += 1
        same += n
    return same / sum(len(a) for a in ref)


@pytest.fixture(scope="module")
def full_precision(llm_fp32):
    tok = llm_fp32.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(p)} for p in PROMPTS]
    return prompts, _tokens(llm_fp32.generate(prompts, _greedy(), use_tqdm=False))


@pytest.mark.model
@pytest.mark.parametrize("fmt,bound", [("int8", 0.5), ("fp8", 0.4)])  # measured 0.745, 0.677
def test_greedy_tokens_agree_with_full_precision_kv(llm_fp32, full_precision, fmt, bound):
    prompts, ref = full_precision
    llm = engine_variant(llm_fp32, cache={"kv_cache_dtype": fmt})
    key_cache = llm.engine.runner.kv_caches[0][0]
    assert key_cache.dtype == QUANT_STORAGE[llm.engine.config.kv_cache_dtype]
    share = _agreement(ref, _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)))
    print(f"{fmt}: greedy prefix agreement with float32 KV {share:.3f}")
    assert share >= bound

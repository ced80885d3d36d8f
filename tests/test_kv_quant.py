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
@pytest.mark.parametrize("head_dim,window", [(64, None), (48, 20), (64, 700)])
def test_decode_kernel_equals_torch_attention_over_dequantized_kv(fmt, head_dim, window):
    """Also past one 512-position span (1100 tokens: split-K, combined by log-sum-exp),
    where a sequence's output must not depend on its batch."""
    k = get_cpu_kernels()
    g = torch.Generator().manual_seed(2)
    H, Hkv, bs, num_blocks = 9, 3, 16, 120
    key_cache = quantize_kv(torch.randn(num_blocks, bs, Hkv, head_dim, generator=g) * 3, fmt)
    value_cache = quantize_kv(torch.randn(num_blocks, bs, Hkv, head_dim, generator=g), fmt)
    seq_lens = torch.tensor([1, 16, 17, 70, 128, 1100])
    block_table = torch.stack([torch.randperm(num_blocks - 1, generator=g)[:70] + 1
                               for _ in seq_lens])
    query = torch.randn(len(seq_lens), H, head_dim, generator=g)
    scale = head_dim ** -0.5
    out = k.paged_attention_decode_quant(fmt, query, key_cache, value_cache, block_table,
                                         seq_lens, scale, window, 2)
    alone = k.paged_attention_decode_quant(fmt, query[-1:], key_cache, value_cache,
                                           block_table[-1:], seq_lens[-1:], scale, window, 1)
    assert torch.equal(alone[0], out[-1])
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
@pytest.mark.parametrize("fmt,bound", [("int8", 0.5), ("fp8", 0.4)])  # measured 0.75-0.80, 0.68-0.70
def test_greedy_tokens_agree_with_full_precision_kv(llm_fp32, full_precision, fmt, bound):
    prompts, ref = full_precision
    llm = engine_variant(llm_fp32, cache={"kv_cache_dtype": fmt})
    key_cache = llm.engine.runner.kv_caches[0][0]
    assert key_cache.dtype == QUANT_STORAGE[llm.engine.config.kv_cache_dtype]
    share = _agreement(ref, _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)))
    print(f"{fmt}: greedy prefix agreement with float32 KV {share:.3f}")
    assert share >= bound


@pytest.mark.model
def test_capacity_planner_and_pool_count_the_smaller_pages(llm_fp32):
    from llmserve.planner.ledger import kv_cache_bytes_per_token

    mc = llm_fp32.engine.config.model_config
    bf16 = kv_cache_bytes_per_token(mc, "bfloat16")
    for fmt in ("int8", "fp8_e4m3"):  # 64 codes + a 2-byte scale per head row vs 128 bytes
        assert kv_cache_bytes_per_token(mc, fmt) * 128 == bf16 * (mc.head_dim + 2)
    sizes = {}
    for kv in ("float32", "int8"):
        llm = engine_variant(llm_fp32, cache={"kv_cache_dtype": kv,
                                              "kv_cache_memory": 64 * 1024**2})
        key_cache = llm.engine.runner.kv_caches[0][0]
        sizes[kv] = llm.engine.num_blocks
        assert key_cache.shape[0] == llm.engine.num_blocks
        # the pool's real bytes are what the engine counted per token
        layer_bytes = 2 * key_cache.numel() * key_cache.element_size()
        assert layer_bytes * mc.num_hidden_layers == \
            llm.engine.num_blocks * 16 * llm.engine.kv_bytes_per_token
    assert sizes["int8"] >= 3.8 * sizes["float32"]  # 256 B vs 66 B per head row


@pytest.fixture(scope="module")
def det_base():
    """The default model in batch-invariant mode (--deterministic): a token's bits do not
    depend on its step, so prefix caching, chunking and preemption must give the same
    tokens and logprobs exactly. (Without it the dense layers' float noise between batch
    shapes flips a few int8 codes, as it flips low bits of float KV, and a greedy tie can
    break differently: measured in test_greedy_tokens_agree_with_full_precision_kv.)"""
    from llmserve import LLM

    return LLM(deterministic=True, kv_cache_memory="64MiB", max_model_len=512)


def _logprobs(outs) -> list:
    return [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]
            for o in outs]


@pytest.mark.model
def test_prefix_caching_chunking_and_cow_keep_int8_tokens(det_base):
    tok = det_base.get_tokenizer()
    system = "You are a concise assistant. Answer in one short sentence. " * 3
    prompts = [{"prompt_token_ids": tok.encode(system + q)}
               for q in ("What is 2+2?", "Name a fruit.", "Define entropy.")]
    no_cache = engine_variant(det_base, cache={"kv_cache_dtype": "int8",
                                               "enable_prefix_caching": False})
    ref = no_cache.generate(prompts, _greedy(8, logprobs=2), use_tqdm=False)
    cached = engine_variant(det_base, scheduler={"max_num_seqs": 1, "max_num_batched_tokens": 24},
                            cache={"kv_cache_dtype": "int8"})
    outs = cached.generate(prompts, _greedy(8, logprobs=2), use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in outs[1:])  # the system prompt's blocks
    assert _tokens(outs) == _tokens(ref)
    assert _logprobs(outs) == _logprobs(ref)  # bit for bit
    # n = 4 siblings recompute the prompt's last token in a shared block: copy-on-write
    params = SamplingParams(n=4, temperature=0.9, seed=7, max_tokens=6, ignore_eos=True)
    out = no_cache.generate(prompts[0], params, use_tqdm=False)[0]
    for i, comp in enumerate(out.outputs):
        alone = SamplingParams(temperature=0.9, seed=7 + i, max_tokens=6, ignore_eos=True)
        want = no_cache.generate(prompts[0], alone, use_tqdm=False)[0]
        assert comp.token_ids == want.outputs[0].token_ids, i


@pytest.mark.model
@pytest.mark.parametrize("fmt", ["int8"])  # (block moves are format-blind: whole rows)
def test_swap_preemption_keeps_quantized_tokens(det_base, fmt):
    tok = det_base.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(f"Chapter {i}. Once upon a time") * 3}
               for i in range(3)]
    plain = engine_variant(det_base, cache={"kv_cache_dtype": fmt,
                                            "enable_prefix_caching": False})
    ref = plain.generate(prompts, _greedy(20, logprobs=1), use_tqdm=False)
    swap = engine_variant(det_base, scheduler={"preemption_mode": "swap", "max_model_len": 128},
                          cache={"kv_cache_dtype": fmt, "num_gpu_blocks_override": 8,
                                 "num_cpu_blocks_override": 64, "enable_prefix_caching": False})
    host = swap.engine.runner.host_kv_caches[0][0]
    assert host.dtype == QUANT_STORAGE[fmt] and host.shape[-1] == 64 + 2
    outs = swap.generate(prompts, _greedy(20, logprobs=1), use_tqdm=False)
    assert swap.engine.scheduler.stats.num_swapped_out_total > 0
    assert _tokens(outs) == _tokens(ref) and _logprobs(outs) == _logprobs(ref)


def test_deploy_spec_passes_kv_cache_dtype_to_the_real_cli():
    import textwrap

    from llmserve.deploy.spec import parse_spec
    from llmserve.deploy.worker_args import worker_args
    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.entrypoints.cli import build_parser

    for name, want in (("fp8", "fp8_e4m3"), ("int8", "int8"), ("fp8_e4m3", "fp8_e4m3")):
        spec = parse_spec(textwrap.dedent(f"""\
            name: demo
            models:
              - name: smollm2
                kv_cache_dtype: {name}
            """))
        args = worker_args(spec.models[0])
        assert args[args.index("--kv-cache-dtype") + 1] == name
        parsed = build_parser().parse_args(["serve", *args])
        engine_args = EngineArgs.from_cli_args(parsed)
        assert CacheConfig(kv_cache_dtype=engine_args.kv_cache_dtype).kv_cache_dtype == want


@pytest.mark.model
def test_kv_store_carries_scales_and_never_crosses_kv_dtypes(det_base):
    from tests.gateway_procs import start_redis

    redis = start_redis()
    try:
        tok = det_base.get_tokenizer()
        prefix = tok.encode("The history of the city begins with a small fishing village. "
                            * 12)[:6 * 16]
        prompt = {"prompt_token_ids": prefix + tok.encode(" What was built first?")}

        def engine(kv: str, store: bool):
            return engine_variant(det_base, cache={"kv_cache_dtype": kv,
                                                   "kv_store": redis.url if store else None})

        cold = engine("int8", False).generate(prompt, _greedy(6, logprobs=2), use_tqdm=False)
        worker_a = engine("int8", True)
        worker_a.generate(prompt, _greedy(2), use_tqdm=False)
        store_a = worker_a.engine.kv_store
        assert store_a.flush() and store_a.stats.writes >= 6
        # one block: 30 layers x (K, V) x 16 tokens x 3 heads x (64 codes + 2 scale bytes)
        assert store_a.layout.block_nbytes == 30 * 2 * 16 * 3 * 66
        worker_b = engine("int8", True)
        out = worker_b.generate(prompt, _greedy(6, logprobs=2), use_tqdm=False)
        assert worker_b.engine.kv_store.stats.hits == 6 and out[0].num_cached_tokens == 96
        assert _tokens(out) == _tokens(cold) and _logprobs(out) == _logprobs(cold)
        # a worker at another KV dtype shares the Redis but never loads int8 pages
        for kv in ("fp8_e4m3", "auto"):
            other = engine(kv, True)
            assert other.engine.kv_store.layout.namespace != store_a.layout.namespace
            got = other.generate(prompt, _greedy(1), use_tqdm=False)[0]
            assert got.num_cached_tokens == 0 and other.engine.kv_store.stats.hits == 0
            other.engine.kv_store.close()
        worker_b.engine.kv_store.close()
        store_a.close()
    finally:
        redis.stop()

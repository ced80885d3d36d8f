"""Per-channel int8 keys (KIVI; issue 15 item 1): ``--kv-key-quant per-channel``.

Oracles: a from-the-definition PyTorch model of the running per-channel absmax (exact
block absmax when no channel grows; the in-place re-rounding ``rint(c * s / n)`` when
one does), float32 softmax attention over the dequantized cache with every token
written then attended in order (the reference backend, one token per step), and for the
engine the same engine at float32 KV (greedy agreement, measured and bounded) and at
the same setting without prefix caching / swap (exact, ``--deterministic``).
"""

from __future__ import annotations

import pytest
import torch

from llmserve.config import CacheConfig
from llmserve.kernels import get_cpu_kernels
from llmserve.layers.attention import (
    CommonAttentionMetadata,
    CpuAttentionBackend,
    ReferenceAttentionBackend,
)
from llmserve.layers.attention import cpu as cpu_backend_module
from llmserve.layers.attention.kv_quant_pc import block_scales, dequantize_key_blocks
from tests.conftest import engine_variant
from tests.test_kv_quant import PROMPTS, _agreement, _greedy, _logprobs, _tokens

needs_kernels = pytest.mark.skipif(get_cpu_kernels() is None, reason="no C compiler")
H, HKV, D, BS = 9, 3, 64, 16


def _caches(num_blocks: int):
    return (torch.zeros(num_blocks, BS + 2, HKV, D, dtype=torch.int8),
            torch.zeros(num_blocks, BS, HKV, D + 2, dtype=torch.int8))


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HKV, D, generator=g)


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).float()


@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-kernel", "torch"])
def test_block_scale_is_the_running_channel_absmax_and_growth_rerounds(use_kernel):
    if use_kernel and get_cpu_kernels() is None:
        pytest.skip("no C compiler")
    from llmserve.layers.attention.kv_quant_pc import write_kv_per_channel

    key = _keys(BS)
    key[0] *= 4  # the first token sets most channels' range: no growth there
    key[9, 1, 5] = 40.0  # a later token grows channel (1, 5) tenfold
    value = _keys(BS, 1)
    kc, vc = _caches(2)
    slots = torch.arange(BS) + BS  # block 1, offsets 0..15, written one call
    if use_kernel:
        get_cpu_kernels().write_kv_quant("int8", key, value, kc, vc, slots)
    else:
        write_kv_per_channel(key, value, kc, vc, slots)
    # the block's scale: fp16(max over its tokens |k| / 127), per (head, channel)
    want_scale = _f16(key.abs().amax(0) / 127)
    assert torch.equal(block_scales(kc[1:2])[0], want_scale)
    # channels that never grew after token 0: plain per-channel rounding
    grown = (key[1:].abs() / 127).to(torch.float16).float() > _f16(key[0].abs() / 127)
    plain = torch.round(key / want_scale).clamp(-127, 127)
    codes = kc[1, :BS].float()
    assert torch.equal(codes[:, ~grown.any(0)], plain[:, ~grown.any(0)])
    # channel (1, 5): tokens 0..8 quantized at the old scale, then re-rounded once
    s_old, s_new = _f16(key[:9, 1, 5].abs().amax() / 127), want_scale[1, 5]
    first = torch.round(key[:9, 1, 5] / s_old).clamp(-127, 127)
    assert torch.equal(codes[:9, 1, 5], torch.round(first * s_old / s_new))
    assert torch.equal(codes[9:, 1, 5], plain[9:, 1, 5])
    # error: half a step of the final grid where a channel never grew; each re-rounding
    # adds half a step of its (smaller) grid, here 1.43 steps at most, on 3.7% of codes
    err = (dequantize_key_blocks(kc[1:2])[0] - key).abs()
    assert torch.all(err <= want_scale * 1.5) and (err > want_scale * 0.501).float().mean() < 0.05
    assert torch.all(err[:, ~grown.any(0)] <= want_scale[~grown.any(0)] * 0.5 * 1.001)
    # a new block (offset 0) starts afresh whatever the stale bytes say
    kc2 = kc.clone()
    small = _keys(1, 2) * 1e-3
    if use_kernel:
        get_cpu_kernels().write_kv_quant("int8", small, small, kc2, vc.clone(),
                                         torch.tensor([BS]))
    else:
        write_kv_per_channel(small, small, kc2, vc.clone(), torch.tensor([BS]))
    assert torch.equal(block_scales(kc2[1:2])[0], _f16(small[0].abs() / 127))


@needs_kernels
def test_write_kernel_equals_torch_token_by_token_on_random_slots():
    from llmserve.layers.attention.kv_quant_pc import write_kv_per_channel

    g = torch.Generator().manual_seed(4)
    T = 70
    key = _keys(T, 5) * torch.logspace(-2, 1, T)[:, None, None]
    key[::7, :, 3] *= 30  # outlier channel, growing
    value = _keys(T, 6)
    order = torch.randperm(5, generator=g) + 1  # five blocks, each filled in order
    slots = torch.cat([b * BS + torch.arange(BS) for b in order])[:T]
    a, b = _caches(6), _caches(6)
    for dtype in (torch.float32, torch.bfloat16):
        get_cpu_kernels().write_kv_quant("int8", key.to(dtype), value.to(dtype), *a, slots)
        write_kv_per_channel(key.to(dtype), value.to(dtype), *b, slots)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _step():
    """Two decodes, a chunk with 21 earlier tokens, a fresh prompt (as test_kv_quant)."""
    return CommonAttentionMetadata.from_lists([1, 1, 19, 37], [30, 5, 40, 37],
                                              [[3, 9], [5], [1, 7, 11], [2, 4, 6]], BS)


def _one_token_steps(md: CommonAttentionMetadata):
    """The step's tokens in order, each as its own one-token step."""
    start = 0
    for q, s, table in zip(md.query_lens, md.seq_lens_list, md.block_table.tolist(),
                           strict=True):
        for p in range(s - q, s):
            yield start, CommonAttentionMetadata.from_lists([1], [p + 1], [table], BS)
            start += 1


@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernels", "torch-fallback"])
@pytest.mark.parametrize("window", [None, 20])
def test_cpu_backend_equals_reference_written_token_by_token(kernels, window, monkeypatch):
    if kernels and get_cpu_kernels() is None:
        pytest.skip("no C compiler")
    if not kernels:
        import llmserve.layers.attention.backend as backend_module

        monkeypatch.setattr(cpu_backend_module, "get_cpu_kernels", lambda: None)
        monkeypatch.setattr(backend_module, "get_cpu_kernels", lambda: None)
    g = torch.Generator().manual_seed(3)
    md = _step()
    md.sliding_window = window
    kc, vc = _caches(12)
    earlier = CommonAttentionMetadata.from_lists([29, 4, 21], [29, 4, 21],
                                                 [[3, 9], [5], [1, 7]], BS)
    ref = ReferenceAttentionBackend(H, D, HKV, D ** -0.5)
    ref.write_kv(torch.randn(54, HKV, D, generator=g) * 3,
                 torch.randn(54, HKV, D, generator=g), kc, vc, earlier.slot_mapping)
    T = md.num_tokens
    query, key, value = (torch.randn(T, n, D, generator=g) for n in (H, HKV, HKV))
    key[5:9, :, 11] = 25.0  # outliers growing the chunk's block scales mid-block
    ref_caches = kc.clone(), vc.clone()
    out = CpuAttentionBackend(H, D, HKV, D ** -0.5).forward(
        query, key, value, kc, vc, CpuAttentionBackend.build_metadata(md))
    want = torch.empty_like(out)
    for t, one in _one_token_steps(md):
        one.sliding_window = window
        want[t] = ref.forward(query[t:t + 1], key[t:t + 1], value[t:t + 1], *ref_caches, one)[0]
    assert torch.equal(kc, ref_caches[0]) and torch.equal(vc, ref_caches[1])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_decode_kernel_scales_the_query_per_block():
    """Decode only (distinct blocks): one parallel call, long contexts split in spans."""
    from llmserve.kernels.cpu_kvc import paged_attention_decode_quant_kc
    from llmserve.layers.attention.kv_quant import dequantize_kv, quantize_kv

    g = torch.Generator().manual_seed(7)
    nb = 90
    kc, _ = _caches(nb)
    codes = torch.randint(-127, 128, (nb, BS, HKV, D), generator=g, dtype=torch.int8)
    scales = (torch.rand(nb, HKV, D, generator=g) * 0.05).to(torch.float16)
    kc[:, :BS] = codes
    kc[:, BS:] = scales.view(torch.int8).view(nb, 2, HKV, D)
    vc = quantize_kv(torch.randn(nb, BS, HKV, D, generator=g), "int8")
    seq_lens = torch.tensor([1, 17, 600, 1300])
    table = torch.stack([torch.randperm(nb - 1, generator=g)[:82] + 1 for _ in seq_lens])
    q = torch.randn(4, H, D, generator=g)
    out = paged_attention_decode_quant_kc(get_cpu_kernels(), q, kc, vc, table, seq_lens,
                                          D ** -0.5, None, 2)
    keys, values = dequantize_key_blocks(kc), dequantize_kv(vc)
    for s, n in enumerate(seq_lens.tolist()):
        kk = keys[table[s]].flatten(0, 1)[:n].repeat_interleave(H // HKV, 1)
        vv = values[table[s]].flatten(0, 1)[:n].repeat_interleave(H // HKV, 1)
        p = (torch.einsum("hd,khd->hk", q[s], kk) * D ** -0.5).softmax(-1)
        torch.testing.assert_close(out[s], torch.einsum("hk,khd->hd", p, vv),
                                   rtol=1e-5, atol=2e-6)


def test_bad_kv_key_quant_is_a_value_error_naming_the_field():
    assert CacheConfig(kv_cache_dtype="int8", kv_key_quant="per_channel").kv_key_quant == \
        "per-channel"
    for bad in ("channel", "", None):
        with pytest.raises(ValueError, match="kv_key_quant must be one of"):
            CacheConfig(kv_cache_dtype="int8", kv_key_quant=bad)
    with pytest.raises(ValueError, match="kv_key_quant per-channel needs kv_cache_dtype int8"):
        CacheConfig(kv_cache_dtype="fp8", kv_key_quant="per-channel")
    with pytest.raises(ValueError, match="kv_eviction_policy"):
        CacheConfig(kv_cache_dtype="int8", kv_key_quant="per-channel",
                    kv_eviction_policy="h2o", kv_budget_tokens=64)


def test_cli_flag_reaches_the_cache_config_and_the_planner_counts_block_scales():
    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.entrypoints.cli import build_parser
    from llmserve.model_config import ModelConfig
    from llmserve.planner.ledger import kv_cache_bytes_per_token

    parsed = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8",
                                        "--kv-key-quant", "per-channel"])
    assert EngineArgs.from_cli_args(parsed).kv_key_quant == "per-channel"
    mc = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=576,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     intermediate_size=64)
    # per KV head: keys (16 + 2) x 64 bytes per 16-token block = 72 per token; values 66
    assert kv_cache_bytes_per_token(mc, "int8", kv_key_quant="per-channel") == 30 * 3 * 138
    assert kv_cache_bytes_per_token(mc, "int8", kv_key_quant="per-channel",
                                    block_size=128) == 30 * 3 * (65 + 66)
    assert kv_cache_bytes_per_token(mc, "int8") == 30 * 3 * 132


# ---------------------------------------------------------------- the engine
PC = {"kv_cache_dtype": "int8", "kv_key_quant": "per-channel"}


@pytest.mark.model
def test_greedy_tokens_agree_with_full_precision_kv(llm_fp32):
    from tests.test_kv_quant import MAX_TOKENS

    tok = llm_fp32.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(p)} for p in PROMPTS]
    ref = _tokens(llm_fp32.generate(prompts, _greedy(), use_tqdm=False))
    llm = engine_variant(llm_fp32, cache={**PC, "kv_cache_memory": 64 * 1024**2})
    kc, vc = llm.engine.runner.kv_caches[0]
    assert kc.shape[1:] == (18, 3, 64) and vc.shape[1:] == (16, 3, 66)
    # the pool's real bytes are what the engine counted per token
    assert 2 * 0 + (kc.numel() + vc.numel()) * 30 == \
        llm.engine.num_blocks * 16 * llm.engine.kv_bytes_per_token
    share = _agreement(ref, _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)))
    print(f"int8 per-channel keys: greedy prefix agreement with float32 KV {share:.3f} "
          f"({len(PROMPTS)} prompts x {MAX_TOKENS} tokens)")
    assert share >= 0.8  # measured 0.958 (int8 per-token: 0.75-0.80)


@pytest.fixture(scope="module")
def det_base():
    from llmserve import LLM

    return LLM(deterministic=True, kv_cache_memory="64MiB", max_model_len=512)


@pytest.mark.model
def test_prefix_caching_chunking_and_swap_keep_tokens(det_base):
    tok = det_base.get_tokenizer()
    system = "You are a concise assistant. Answer in one short sentence. " * 3
    prompts = [{"prompt_token_ids": tok.encode(system + q)}
               for q in ("What is 2+2?", "Name a fruit.", "Define entropy.")]
    no_cache = engine_variant(det_base, cache={**PC, "enable_prefix_caching": False})
    ref = no_cache.generate(prompts, _greedy(8, logprobs=2), use_tqdm=False)
    cached = engine_variant(det_base, scheduler={"max_num_seqs": 1,
                                                 "max_num_batched_tokens": 24}, cache=PC)
    outs = cached.generate(prompts, _greedy(8, logprobs=2), use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in outs[1:])
    assert _tokens(outs) == _tokens(ref) and _logprobs(outs) == _logprobs(ref)
    swap = engine_variant(det_base, scheduler={"preemption_mode": "swap", "max_model_len": 128},
                          cache={**PC, "num_gpu_blocks_override": 8,
                                 "num_cpu_blocks_override": 64, "enable_prefix_caching": False})
    host = swap.engine.runner.host_kv_caches[0][0]
    assert host.shape[1:] == (18, 3, 64)
    many = [{"prompt_token_ids": tok.encode(f"Chapter {i}. Once upon a time") * 3}
            for i in range(3)]
    want = no_cache.generate(many, _greedy(20, logprobs=1), use_tqdm=False)
    got = swap.generate(many, _greedy(20, logprobs=1), use_tqdm=False)
    assert swap.engine.scheduler.stats.num_swapped_out_total > 0
    assert _tokens(got) == _tokens(want) and _logprobs(got) == _logprobs(want)

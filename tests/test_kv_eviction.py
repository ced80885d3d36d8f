"""Page-granular KV eviction (issue 15, item 2): StreamingLLM, H2O, SnapKV.

Oracles: kvpress's StreamingLLMPress rule for the kept positions (kvpress itself pins
an older transformers than this project, so its ``score`` rule is transcribed below);
transformers on the same random weights (fp32, eager attention) for the attention
scores H2O and SnapKV rank blocks by, and for the tokens generated after an eviction
(its KV cache pruned to the kept positions, the next tokens at their true positions);
the block pool's own counts for the fixed budget on a long generation.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from llmserve.config import KV_EVICTION_POLICIES, CacheConfig
from llmserve.kv_cache.eviction import available_eviction_policies, make_eviction_state

VOCAB, BLOCK = 4096, 4
PROMPT, BUDGET, SINKS = 64, 32, 4  # budget 8 blocks, 1 sink block


def kvpress_streaming_llm_keep(k_len: int, compression_ratio: float, n_sink: int) -> list[int]:
    """Positions StreamingLLMPress keeps: its ``score`` (kvpress 0.5.5,
    presses/streaming_llm_press.py) then ScorerPress's top-k of ``int(k_len * (1 - r))``."""
    n_pruned = k_len - int(k_len * (1 - compression_ratio))
    scores = torch.ones(k_len)
    scores[n_sink:n_sink + n_pruned] = 0
    n_kept = int(k_len * (1 - compression_ratio))
    return sorted(scores.topk(n_kept).indices.tolist())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, gguf_path):
    """(transformers model, eager attention; our LLM on its saved weights)."""
    from llmserve import LLM
    from llmserve.loader import resolve_model
    from llmserve.tokenizer import load_tokenizer

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        attn_implementation="eager")
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(path)
    load_tokenizer(resolve_model(gguf_path)).save_pretrained(path)
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, num_gpu_blocks_override=64,
              enable_prefix_caching=False)
    return hf, llm


def _prompt(seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(llm, prompt, params, rid="r"):
    """Step the engine; returns (tokens, kept logical blocks right after the first
    eviction, the accumulated block scores just before it, blocks held per step)."""
    engine = llm.engine
    sched, kv = engine.scheduler, engine.scheduler.kv_cache_manager
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    tokens, first_kept, scores_before, held = [], None, None, []
    while engine.has_unfinished_requests():
        req = sched.requests.get(rid)
        if req is not None and req.eviction is not None and first_kept is None:
            scores_before = list(req.eviction.scores)
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        held.append(kv.num_usable_blocks - kv.get_num_free_blocks())
        req = sched.requests.get(rid)
        if first_kept is None and req is not None and kv.num_evicted_tokens.get(rid):
            req.eviction.sync(len(kv.get_block_ids(rid)))  # (the block just allocated)
            first_kept = list(req.eviction.logical)
    assert kv.get_num_free_blocks() == kv.num_usable_blocks  # every block free at the end
    return tokens, first_kept, scores_before, held


def _hf_after_pruning(hf, prompt, keep_positions, first_token, num_new):
    """transformers' greedy tokens after ``first_token`` when its KV cache is pruned to
    ``keep_positions`` after the prompt (kept keys keep their RoPE; new tokens take
    their true positions), as kvpress runs a press."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        cache = out.past_key_values
        keep = torch.tensor(keep_positions)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
        tokens, tok, n = [first_token], first_token, len(keep_positions)
        for i in range(num_new):
            logits = hf(torch.tensor([[tok]]), position_ids=torch.tensor([[len(prompt) + i]]),
                        past_key_values=cache, cache_position=torch.tensor([n + i]),
                        use_cache=True).logits
            tok = int(logits[0, -1].argmax())
            tokens.append(tok)
    return tokens


def _params(policy, **kw):
    from llmserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1 + BLOCK, ignore_eos=True,
                          kv_eviction_policy=policy, kv_budget_tokens=BUDGET,
                          num_sink_tokens=SINKS, **kw)


def test_streaming_llm_keeps_kvpress_positions_and_decodes_as_transformers(tiny):
    hf, llm = tiny
    prompt = _prompt()
    tokens, kept, _, held = _run(llm, prompt, _params("streaming_llm"))
    # the first decode step keeps 8 blocks: the sink block, 6 recent prompt blocks and
    # the block it writes -> 28 prompt tokens = kvpress with compression 1 - 28/64
    ours = [p for b in kept for p in range(b * BLOCK, (b + 1) * BLOCK) if p < PROMPT]
    assert ours == kvpress_streaming_llm_keep(PROMPT, 1 - 28 / PROMPT, SINKS)
    assert max(held[1:]) <= BUDGET // BLOCK
    # the tokens after the eviction (until the next one): transformers on the pruned cache
    assert tokens == _hf_after_pruning(hf, prompt, ours, tokens[0], BLOCK)


def _reference_block_scores(hf, prompt, first_row: int) -> torch.Tensor:
    """Attention mass per block from transformers' eager attention probabilities,
    summed over layers, heads and the query rows >= first_row."""
    with torch.no_grad():
        atts = hf(torch.tensor([prompt]), output_attentions=True).attentions
    per_key = sum(a[0, :, first_row:].sum(dim=(0, 1)) for a in atts)  # [PROMPT]
    return per_key.view(-1, BLOCK).sum(1)


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_attention_policies_keep_the_blocks_reference_scoring_picks(tiny, policy):
    from llmserve import SamplingParams

    hf, llm = tiny
    prompt = _prompt(2)
    window = 16
    params = SamplingParams(temperature=0.0, max_tokens=1 + BLOCK, ignore_eos=True,
                            kv_eviction_policy=policy, kv_budget_tokens=BUDGET)
    if policy == "snapkv":  # a 16-token observation window (the engine's default is 64)
        llm.engine.scheduler.kv_limits.window_tokens = window
    try:
        tokens, kept, scores, _ = _run(llm, prompt, params)
    finally:
        llm.engine.scheduler.kv_limits.window_tokens = 64
    ref = _reference_block_scores(hf, prompt, 0 if policy == "h2o" else PROMPT - window)
    torch.testing.assert_close(torch.tensor(scores), ref, rtol=1e-4, atol=1e-4)
    num_blocks, budget = PROMPT // BLOCK, BUDGET // BLOCK
    evict = num_blocks + 1 - budget  # the first decode needs one more block
    if policy == "h2o":  # heavy hitters outside the recent half of the budget
        cands = list(range(num_blocks - budget // 2))
    else:  # the prompt blocks before the observation window
        cands = list(range((PROMPT - window) // BLOCK))
    order = sorted(cands, key=lambda i: (float(ref[i]), i))
    gap = float(ref[order[evict]] - ref[order[evict - 1]])
    assert gap > 1e-3  # no near-tie at the cut: the picks are well defined
    expect = sorted(set(range(num_blocks)) - set(order[:evict])) + [num_blocks]
    assert kept == expect
    ours = [p for b in kept for p in range(b * BLOCK, (b + 1) * BLOCK) if p < PROMPT]
    assert tokens == _hf_after_pruning(hf, prompt, ours, tokens[0], BLOCK)


def test_registry_config_and_bad_settings(tiny):
    from llmserve import SamplingParams

    assert available_eviction_policies() == sorted(KV_EVICTION_POLICIES)
    import argparse

    from llmserve.engine.arg_utils import EngineArgs

    cli = EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--kv-eviction-policy", "h2o", "--kv-budget-tokens", "64", "--num-sink-tokens", "8"]))
    assert (cli.kv_eviction_policy, cli.kv_budget_tokens, cli.num_sink_tokens) == ("h2o", 64, 8)
    with pytest.raises(ValueError, match="kv_eviction_policy"):
        CacheConfig(kv_eviction_policy="lru")
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        make_eviction_state("h2o", None, 4, 64, BLOCK)
    with pytest.raises(ValueError, match="at least"):
        make_eviction_state("streaming_llm", 8, 4, 64, BLOCK)  # 2 blocks: sink + 1
    with pytest.raises(ValueError, match="kv_budget_tokens must be > 0"):
        SamplingParams(kv_budget_tokens=0)
    _, llm = tiny
    with pytest.raises(ValueError, match="unknown kv_eviction_policy 'lru'"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                     SamplingParams(kv_eviction_policy="lru", kv_budget_tokens=64),
                     use_tqdm=False)
    assert llm.engine.get_num_unfinished_requests() == 0


def _generate_checking_blocks(engine, requests: dict[str, tuple], budget_blocks: dict[str, int]):
    """Add ``requests`` (id -> (prompt, params)), step to the end; after every step each
    running request past its prompt holds at most its budget of blocks. Returns
    (output token counts, the most blocks the pool had in use)."""
    sched, kv = engine.scheduler, engine.scheduler.kv_cache_manager
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    counts, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
        for rid in requests:
            req = sched.requests.get(rid)
            if req is not None and req.num_computed_tokens > req.num_prompt_tokens:
                assert len(kv.get_block_ids(rid)) <= budget_blocks[rid], rid
        peak = max(peak, kv.num_usable_blocks - kv.get_num_free_blocks())
    assert kv.get_num_free_blocks() == kv.num_usable_blocks  # every block back in the pool
    return counts, peak


def test_long_generation_in_a_fixed_number_of_blocks_per_policy(tiny):
    """Three requests batched, one per policy (per-request overrides), 512 tokens each
    (16 budgets) in a pool of 3 budgets plus prompt room: far less than 3 x 576 tokens."""
    from llmserve import SamplingParams
    from tests.conftest import engine_variant

    _, base = tiny
    engine = engine_variant(base, cache={"num_gpu_blocks_override": 3 * 8 + 3 * 16 + 1}).engine
    new = 512
    reqs = {pol: ({"prompt_token_ids": _prompt(i)}, SamplingParams(
        temperature=0.0, max_tokens=new, ignore_eos=True, kv_eviction_policy=pol,
        kv_budget_tokens=BUDGET)) for i, pol in enumerate(["streaming_llm", "h2o", "snapkv"])}
    engine.scheduler.kv_limits.window_tokens = 16  # SnapKV's window within the budget
    counts, peak = _generate_checking_blocks(engine, reqs, dict.fromkeys(reqs, BUDGET // BLOCK))
    assert counts == dict.fromkeys(reqs, new)
    assert engine.scheduler.stats.num_preemptions_total == 0


@pytest.mark.model
def test_default_model_streaming_llm_long_generation(gguf_path):
    """The default model (SmolLM2-135M, bf16, native 4-bit), engine-wide StreamingLLM at
    32 tokens: two batched 256-token generations (8 budgets each) in a 12-block pool (96
    tokens, block size 8)."""
    from llmserve import LLM, SamplingParams

    llm = LLM(gguf_path, block_size=8, num_gpu_blocks_override=13, max_num_batched_tokens=32,
              kv_eviction_policy="streaming_llm", kv_budget_tokens=32, num_sink_tokens=4)
    assert llm.engine.max_kv_tokens == llm.engine.max_model_len  # capped: may run long
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    reqs = {"a": ("Write a long story about a dragon.", params),
            "b": ("List the prime numbers in order, starting with 2.", params)}
    counts, peak = _generate_checking_blocks(llm.engine, reqs, {"a": 4, "b": 4})
    assert counts == {"a": 256, "b": 256} and peak <= 8


def test_scored_attention_equals_reference_and_sums_probabilities(monkeypatch):
    """The scored path (row tiles of 8 here) gives the reference backend's output, and
    its block scores are the reference softmax's mass per block."""
    from llmserve.layers.attention import CommonAttentionMetadata, ReferenceAttentionBackend
    from llmserve.layers.attention import scored as scored_mod
    from llmserve.layers.attention.scored import BlockScoreRequest, scored_attention

    monkeypatch.setattr(scored_mod, "ROW_TILE", 8)
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    key_cache = torch.randn(12, bs, kv_heads, dim)
    value_cache = torch.randn(12, bs, kv_heads, dim)
    tables = [[3, 7, 1, 9, 4], [2, 5, 8]]  # a decode-like 1-token query and a 10-token chunk
    md = CommonAttentionMetadata.from_lists([1, 10], [18, 11], tables, bs)
    query = torch.randn(11, heads, dim)
    backend = ReferenceAttentionBackend(heads, dim, kv_heads, 0.3)
    ref = backend.forward(query, torch.zeros(11, kv_heads, dim), torch.zeros(11, kv_heads, dim),
                          key_cache.clone(), value_cache.clone(), md)
    md.block_scores = {1: BlockScoreRequest(3, torch.zeros(3))}
    # (K/V already in the cache: write this step's rows as the reference did)
    flat_k, flat_v = key_cache.view(-1, kv_heads, dim), value_cache.view(-1, kv_heads, dim)
    flat_k[md.slot_mapping] = 0
    flat_v[md.slot_mapping] = 0
    out = scored_attention(backend, query, key_cache, value_cache, md)
    torch.testing.assert_close(out, ref)
    # reference mass: sequence 1, query rows 3..9 (positions 4..10), keys 0..10
    keys = key_cache[[2, 5, 8]].flatten(0, 1)[:11].repeat_interleave(2, 1)
    s = torch.einsum("qhd,khd->hqk", query[1 + 3:], keys) * 0.3
    mask = torch.arange(11)[None, :] <= torch.arange(4, 11)[:, None]
    probs = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).sum((0, 1))
    want = torch.nn.functional.pad(probs, (0, 1)).view(3, 4).sum(1)
    torch.testing.assert_close(md.block_scores[1].scores, want)


def _h2o_trace(engine, prompts, new):
    """Generate greedily under H2O with the second request joining after 5 steps (mixed
    decode + prompt steps); per step, every request's kept blocks and block scores."""
    from llmserve import SamplingParams

    sched = engine.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True,
                            kv_eviction_policy="h2o", kv_budget_tokens=BUDGET)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, params)
    tokens, trace, steps = {}, [], 0
    while engine.has_unfinished_requests():
        if steps == 5:
            engine.add_request("b", {"prompt_token_ids": prompts[1]}, params)
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        trace.append({rid: (list(r.eviction.logical), list(r.eviction.scores))
                      for rid, r in sched.requests.items() if r.eviction is not None})
    return tokens, trace


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_h2o_decode_scores_from_the_kernel_match_the_pytorch_path(tiny, monkeypatch,
                                                                  kv_cache_dtype):
    """H2O's decode and prompt rows take the C decode kernel's score accumulator (no row
    runs the PyTorch scored path); tokens, evictions and scores equal the all-PyTorch
    path's (float32 pages, and int8 pages: the PyTorch path reads them dequantized)."""
    from llmserve.layers.attention import scored
    from tests.conftest import engine_variant

    _, base = tiny
    prompts = [_prompt(5), _prompt(6)[:40]]
    calls = []
    real = scored.scored_attention

    def spy(backend, query, key_cache, value_cache, common, first_seq=0, end_seq=None):
        calls.append(first_seq < common.num_decodes)  # a decode row sent to PyTorch
        return real(backend, query, key_cache, value_cache, common, first_seq, end_seq)

    monkeypatch.setattr(scored, "scored_attention", spy)
    runs = {}
    for kernel in (True, False):
        monkeypatch.setattr(scored, "KERNEL_DECODE_SCORES", kernel)
        monkeypatch.setattr(scored, "KERNEL_PROMPT_SCORES", kernel)
        calls.clear()
        engine = engine_variant(base, cache={"num_gpu_blocks_override": 40,
                                             "kv_cache_dtype": kv_cache_dtype}).engine
        runs[kernel] = _h2o_trace(engine, prompts, 48)
        assert (not calls) if kernel else any(calls)  # the kernel run: no row in PyTorch
    (tok_k, trace_k), (tok_p, trace_p) = runs[True], runs[False]
    assert tok_k == tok_p and len(tok_k["a"]) == len(tok_k["b"]) == 48
    assert len(trace_k) == len(trace_p)
    for step_k, step_p in zip(trace_k, trace_p, strict=True):
        assert step_k.keys() == step_p.keys()
        for rid, (kept, scores) in step_k.items():
            assert kept == step_p[rid][0]  # the same blocks evicted
            # int8: the prompt rows' outputs differ in the last bits between the paths, so
            # a few K/V codes round the other way in later layers
            rtol = 1e-3 if kv_cache_dtype == "int8" else 1e-4
            torch.testing.assert_close(torch.tensor(scores), torch.tensor(step_p[rid][1]),
                                       rtol=rtol, atol=1e-4)

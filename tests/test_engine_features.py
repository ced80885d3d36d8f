"""Prefix caching, n > 1 with shared prompt KV, beam search, priority scheduling and
swap preemption on the real default model. Oracles: the same engine with the
feature off (greedy outputs must not change), separate seeded runs, and
transformers' beam search."""

from __future__ import annotations

import pytest

from llmserve import SamplingParams
from tests.conftest import engine_variant

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.model

SYSTEM = ("You are a careful assistant. Answer briefly and precisely, cite facts, and never "
          "invent numbers. ") * 3


def _greedy(n=16, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _all_free(llm):
    mgr = llm.engine.scheduler.kv_cache_manager
    assert mgr.get_num_free_blocks() == mgr.num_usable_blocks
    assert not llm.engine.scheduler.requests


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def no_cache(llm_fp32):
    return engine_variant(llm_fp32, cache={"enable_prefix_caching": False})


def test_prefix_caching_does_not_change_greedy_outputs(llm_fp32, no_cache):
    tok = llm_fp32.get_tokenizer()
    questions = ["What is 2+2?", "Name a fruit.", "Where is Paris?", "Who wrote Hamlet?",
                 "What colour is the sky?", "Define entropy."]
    prompts = [{"prompt_token_ids": tok.encode(SYSTEM + q)} for q in questions]
    ref = _tokens(no_cache.generate(prompts, _greedy(), use_tqdm=False))
    # two at a time: later prompts join a running batch and hit the cached system prompt
    cached = engine_variant(llm_fp32, scheduler={"max_num_seqs": 2},
                            cache={"enable_prefix_caching": True})
    outs = cached.generate(prompts, _greedy(), use_tqdm=False)
    assert _tokens(outs) == ref
    assert all(o.num_cached_tokens > 0 for o in outs[2:])
    assert cached.engine.scheduler.stats.prefix_cache_hits_total > 0
    # a tiny cache: blocks of earlier prompts are evicted and recomputed, same tokens
    small = engine_variant(llm_fp32, cache={"num_gpu_blocks_override": 12},
                           scheduler={"max_num_seqs": 1, "max_model_len": 160})
    assert _tokens(small.generate(prompts, _greedy(), use_tqdm=False)) == ref
    assert small.engine.scheduler.kv_cache_manager.block_pool.num_evictions > 0
    assert _tokens(small.generate(prompts[:1], _greedy(), use_tqdm=False)) == ref[:1]
    for llm in (cached, small, no_cache):
        _all_free(llm)


def test_shared_1000_token_prefix_computes_only_uncached_tokens(llm_fp32):
    llm = engine_variant(llm_fp32)
    tok = llm.get_tokenizer()
    prefix = tok.encode("The quick brown fox jumps over the lazy dog. " * 120)[:1000]
    first = prefix + tok.encode(" First question: why?")
    second = prefix + tok.encode(" Second question: how exactly?")
    stats = llm.engine.scheduler.stats
    llm.generate({"prompt_token_ids": first}, _greedy(4), use_tqdm=False)
    before = stats.num_scheduled_tokens_total
    out = llm.generate({"prompt_token_ids": second}, _greedy(4), use_tqdm=False)[0]
    scheduled = stats.num_scheduled_tokens_total - before
    hit = 1000 // 16 * 16  # the full blocks of the shared prefix
    assert out.num_cached_tokens == hit
    assert scheduled == (len(second) - hit) + 3  # uncached prompt tokens + 3 decodes
    # another tenant's salt: no hit at all
    salted = llm.generate({"prompt_token_ids": second, "cache_salt": "tenant-b"}, _greedy(4),
                          use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0
    assert salted.outputs[0].token_ids == out.outputs[0].token_ids
    _all_free(llm)


def test_n4_seeded_computes_prompt_once_and_equals_separate_runs(no_cache):
    tok = no_cache.get_tokenizer()
    prompt = tok.encode("Write a short poem about the sea:")
    params = SamplingParams(n=4, temperature=0.9, top_p=0.95, seed=1234, max_tokens=12,
                            ignore_eos=True)
    stats = no_cache.engine.scheduler.stats
    before = stats.num_scheduled_tokens_total
    out = no_cache.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    scheduled = stats.num_scheduled_tokens_total - before
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    # the prompt once, 3 siblings recompute only its last token, then 11 decodes each
    assert scheduled == len(prompt) + 3 + 4 * 11
    for i, comp in enumerate(out.outputs):
        alone = SamplingParams(temperature=0.9, top_p=0.95, seed=1234 + i, max_tokens=12,
                               ignore_eos=True)
        ref = no_cache.generate({"prompt_token_ids": prompt}, alone, use_tqdm=False)[0]
        assert comp.token_ids == ref.outputs[0].token_ids, i
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    _all_free(no_cache)


def test_beam_search_matches_transformers(llm_fp32, hf_model):
    from llmserve.beam_search import BeamSearchParams

    tok = llm_fp32.get_tokenizer()
    prompt = tok.encode("The best way to learn a new language is")
    res = llm_fp32.beam_search({"prompt_token_ids": prompt},
                               BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))[0]
    with torch.inference_mode():
        hf = hf_model.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=4,
                               do_sample=False, max_new_tokens=12, min_new_tokens=12,
                               eos_token_id=None, pad_token_id=0, length_penalty=1.0,
                               output_scores=True, return_dict_in_generate=True)
    hf_seqs = [s[len(prompt):].tolist() for s in hf.sequences]
    ours = [b.tokens[len(prompt):] for b in res.sequences]
    assert ours[0] == hf_seqs[0]
    assert sorted(ours) == sorted(hf_seqs)
    scores = [b.cum_logprob / len(b.tokens) for b in res.sequences]
    assert scores == sorted(scores, reverse=True)
    _all_free(llm_fp32)


def test_priority_late_vip_finishes_first(llm_fp32):
    llm = engine_variant(llm_fp32, scheduler={"scheduling_policy": "priority",
                                              "max_model_len": 256},
                         cache={"num_gpu_blocks_override": 17})  # 16 blocks: 256 tokens
    eng = llm.engine
    tok = llm.get_tokenizer()
    for i in range(3):
        eng.add_request(f"low{i}", {"prompt_token_ids": tok.encode(f"Story number {i}:") * 6},
                        _greedy(60), priority=10)
    finished_order = []
    for _ in range(5):
        finished_order += [o.request_id for o in eng.step() if o.finished]
    eng.add_request("vip", {"prompt_token_ids": tok.encode("Urgent: summarize the news.") * 5},
                    _greedy(20), priority=0)
    while eng.has_unfinished_requests():
        finished_order += [o.request_id for o in eng.step() if o.finished]
    assert sorted(finished_order) == ["low0", "low1", "low2", "vip"]
    assert finished_order[0] == "vip"
    _all_free(llm)


def test_swap_preemption_outputs_equal_unpreempted_run(llm_fp32, no_cache):
    tok = llm_fp32.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(f"Chapter {i}. Once upon a time") * 4}
               for i in range(4)]
    ref = _tokens(no_cache.generate(prompts, _greedy(40), use_tqdm=False))
    swap = engine_variant(llm_fp32, scheduler={"preemption_mode": "swap", "max_model_len": 128},
                          cache={"num_gpu_blocks_override": 14, "num_cpu_blocks_override": 64,
                                 "enable_prefix_caching": False})
    outs = swap.generate(prompts, _greedy(40), use_tqdm=False)
    stats = swap.engine.scheduler.stats
    assert stats.num_swapped_out_total > 0
    assert _tokens(outs) == ref
    host = swap.engine.scheduler.host_pool
    assert host.get_num_free_blocks() == host.num_usable_blocks
    _all_free(swap)


def test_request_outgrowing_the_whole_cache_ends_with_length(llm_fp32):
    # 8 blocks of 16 = 128 token slots, max_model_len larger: the request runs alone
    # until the cache is full, then ends with what it has (never silently dropped)
    llm = engine_variant(llm_fp32, cache={"num_gpu_blocks_override": 9},
                         scheduler={"max_model_len": 512})
    out = llm.generate({"prompt_token_ids": [504] * 100}, _greedy(100), use_tqdm=False)
    assert len(out) == 1
    comp = out[0].outputs[0]
    assert comp.finish_reason == "length"
    # the KV of 128 tokens fits; the 129th token is sampled from the last position
    assert len(comp.token_ids) == 128 - 100 + 1
    assert llm.generate("Hello", _greedy(3), use_tqdm=False)[0].outputs[0].finish_reason \
        == "length"
    _all_free(llm)

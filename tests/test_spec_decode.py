"""Speculative decoding on the real default model (float32): greedy outputs with
n-gram drafts and with a draft model (the model drafting for itself) are the
target's own greedy tokens, for a continuous batch with chunked prefill,
prefix-cache hits, preemption, n > 1, stop strings, max_tokens and EOS; every KV
block is free at the end. Oracle: the same engine without speculation."""

from __future__ import annotations

import dataclasses

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.llm_engine import LLMEngine
from llmserve.spec_decode import SpeculativeConfig

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.model

SHARED = "You are a helpful assistant. Repeat the user's text exactly, word for word. "
PROMPTS = [
    SHARED + "the quick brown fox jumps over the lazy dog. the quick brown fox",
    SHARED + "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "List the days of the week: Monday, Tuesday,",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]


def _params():
    """Per prompt: a stop string, max_tokens inside a run, plain, EOS (no ignore_eos)."""
    return [SamplingParams(temperature=0.0, max_tokens=14, stop=["fox is"]),
            SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=2),
            SamplingParams(temperature=0.0, max_tokens=12)]


def _spec_engine(base: LLM, spec: dict, draft: bool = False, scheduler=None, cache=None) -> LLM:
    cfg = base.engine.config
    cfg = dataclasses.replace(
        cfg, speculative_config=SpeculativeConfig.from_value(spec),
        scheduler_config=dataclasses.replace(cfg.scheduler_config, **(scheduler or {})),
        cache_config=dataclasses.replace(cfg.cache_config, **(cache or {})))
    model = base.engine.runner.model
    return LLM.from_engine(LLMEngine(cfg, base.engine.tokenizer, model,
                                     draft_model=model if draft else None))


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outs]


def _all_free(llm: LLM) -> None:
    mgr = llm.engine.scheduler.kv_cache_manager
    assert mgr.get_num_free_blocks() == mgr.num_usable_blocks
    assert not llm.engine.scheduler.requests and not mgr.req_to_blocks


@pytest.fixture(scope="module")
def reference(llm_fp32):
    """Non-speculative greedy outputs; a prompt is submitted twice (a prefix-cache hit)."""
    outs = llm_fp32.generate(PROMPTS + PROMPTS[:1], _params() + _params()[:1], use_tqdm=False)
    ref = _summary(outs)
    assert ref[0][0][2] == "stop" and ref[0][0][3] == "fox is"  # the stop string is hit
    assert len(ref[1][0][0]) == 11
    assert ref[3][0][2] == "stop" and len(ref[3][0][0]) < 12  # EOS
    return ref


def test_ngram_greedy_identical_in_a_continuous_batch(llm_fp32, reference):
    # a 32-token budget chunks every prompt and mixes chunks with verified decodes
    llm = _spec_engine(llm_fp32, {"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                       scheduler={"max_num_batched_tokens": 32})
    outs = llm.generate(PROMPTS + PROMPTS[:1], _params() + _params()[:1], use_tqdm=False)
    assert _summary(outs) == reference
    stats = llm.engine.spec_decoding_stats
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0
    assert llm.engine.scheduler.kv_cache_manager.stats.hits > 0
    _all_free(llm)


def test_draft_model_greedy_identical_with_preemption(llm_fp32, reference):
    # the model drafting for itself: every greedy draft must be accepted (to rounding);
    # 12 blocks of 16 tokens cannot hold the whole batch: requests are preempted
    llm = _spec_engine(llm_fp32, {"method": "draft_model", "model": "self",
                                  "num_speculative_tokens": 3}, draft=True,
                       cache={"num_gpu_blocks_override": 12})
    outs = llm.generate(PROMPTS + PROMPTS[:1], _params() + _params()[:1], use_tqdm=False)
    assert _summary(outs) == reference
    stats = llm.engine.spec_decoding_stats
    assert stats.num_draft_tokens > 20 and stats.acceptance_rate > 0.9
    assert llm.engine.scheduler.stats.num_preemptions_total > 0
    _all_free(llm)
    llm.engine.step()  # finished requests reach the runner with the next step
    proposer = llm.engine.runner.spec_decoder.proposer
    assert not proposer.valid and not proposer.probs  # per-request draft state dropped


def test_draft_catch_up_runs_as_decodes(llm_fp32, reference, monkeypatch):
    """The draft's forward on the few tokens the target just accepted (at most
    CATCH_UP_AS_DECODE a row) runs as one-token decodes, so it takes the decode path's
    packed kernels, not the prompt path (gguf-hybrid's dense copy); only a prompt's
    catch-up stays a prefill row, and its time is kept out of the adaptive policy's
    draft cost. Outputs stay the target's greedy tokens."""
    from llmserve.spec_decode import draft_model

    calls, expanded = [], []
    real_meta, real_expand = draft_model.CommonAttentionMetadata, draft_model.per_token_metadata

    def meta(**kw):
        calls.append((kw["num_decodes"], list(kw["query_lens"])))
        return real_meta(**kw)

    def expand(query_lens, *a):
        expanded.append(list(query_lens))
        return real_expand(query_lens, *a)

    monkeypatch.setattr(draft_model, "CommonAttentionMetadata", meta)
    monkeypatch.setattr(draft_model, "per_token_metadata", expand)
    llm = _spec_engine(llm_fp32, {"method": "draft_model", "model": "self",
                                  "num_speculative_tokens": 3}, draft=True)
    spec = llm.engine.runner.spec_decoder
    proposals, observed = [], []  # a prompt's catch-up is not a draft position's cost
    real_propose, real_observe = spec.proposer.propose, spec.policy.cost_model.observe_draft

    def propose(*a):
        out = real_propose(*a)
        proposals.append(spec.proposer.last_propose_prefilled)
        return out

    def observe_draft(*a):
        observed.append(proposals[-1])
        return real_observe(*a)

    monkeypatch.setattr(spec.proposer, "propose", propose)
    monkeypatch.setattr(spec.policy.cost_model, "observe_draft", observe_draft)
    outs = llm.generate(PROMPTS + PROMPTS[:1], _params() + _params()[:1], use_tqdm=False)
    assert _summary(outs) == reference
    assert any(max(q) > 1 for q in expanded)  # multi-token catch-ups were expanded
    assert any(proposals) and observed and not any(observed)
    assert len(observed) == proposals.count(False)
    for num_decodes, qlens in calls:
        assert qlens[:num_decodes] == [1] * num_decodes
        assert all(q > draft_model.CATCH_UP_AS_DECODE for q in qlens[num_decodes:]), qlens
    _all_free(llm)


def test_draft_vocab_subset_is_lossless(llm_fp32, reference):
    """FR-Spec's reduced draft vocabulary: the draft (the default GGUF loaded again,
    tied embeddings) scores only ids below 2048, so it never drafts a larger id, and the
    outputs stay the target's greedy tokens."""
    from llmserve.spec_decode.draft_model import load_draft_model

    spec = {"method": "draft_model", "model": llm_fp32.engine.config.model,
            "num_speculative_tokens": 3, "draft_vocab_size": 2048}
    cfg = dataclasses.replace(llm_fp32.engine.config,
                              speculative_config=SpeculativeConfig.from_value(spec))
    draft = load_draft_model(cfg, llm_fp32.engine.tokenizer)
    assert draft.lm_head.output_size == 2048
    llm = LLM.from_engine(LLMEngine(cfg, llm_fp32.engine.tokenizer,
                                    llm_fp32.engine.runner.model, draft_model=draft))
    proposer = llm.engine.runner.spec_decoder.proposer
    drafted, real_propose = [], proposer.propose

    def propose(*a):
        out = real_propose(*a)
        drafted.extend(t for d in out for t in d)
        return out

    proposer.propose = propose
    outs = llm.generate(PROMPTS + PROMPTS[:1], _params() + _params()[:1], use_tqdm=False)
    assert _summary(outs) == reference
    assert len(drafted) > 20 and max(drafted) < 2048
    assert any(t >= 2048 for o in outs for c in o.outputs for t in c.token_ids)
    assert llm.engine.spec_decoding_stats.num_accepted_tokens > 0
    _all_free(llm)


def test_adaptive_policy_times_its_costs_at_start_up(llm_fp32, reference):
    """The adaptive policy starts from timed dummy steps (calibrate.py), not priors:
    every batch-size bucket up to 8 has its step-time fit and draft cost before the
    first request, and the dummy steps (block 0, slot 0) leave outputs unchanged."""
    llm = _spec_engine(llm_fp32, {"method": "draft_model", "model": "self",
                                  "num_speculative_tokens": 3,
                                  "draft_length_policy": "adaptive"}, draft=True)
    cost_model = llm.engine.runner.spec_decoder.policy.cost_model
    for batch in (1, 2, 4, 8):
        a, b = cost_model.coefficients(batch)
        assert a > 0 and b >= 0
        assert cost_model.relative_cost(batch) > 0
    assert cost_model.coefficients(16) is None  # larger buckets learn online
    outs = llm.generate(PROMPTS + PROMPTS[:1], _params() + _params()[:1], use_tqdm=False)
    assert _summary(outs) == reference
    _all_free(llm)


def test_seeded_sampling_same_alone_or_batched_and_aborts_free_blocks(llm_fp32):
    llm = _spec_engine(llm_fp32, {"method": "draft_model", "model": "self",
                                  "num_speculative_tokens": 3}, draft=True)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11, max_tokens=10,
                        ignore_eos=True)
    alone = llm.generate(PROMPTS[1], sp, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batched = llm.generate([PROMPTS[2], PROMPTS[1], PROMPTS[3]], [other, sp, other],
                           use_tqdm=False)[1].outputs[0].token_ids
    assert batched == alone and len(alone) == 10
    assert llm.engine.spec_decoding_stats.num_accepted_tokens > 0
    # abort in the middle of speculative runs: every block comes back
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"a{i}", p, SamplingParams(temperature=0.0, max_tokens=14,
                                                      ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request(["a0", "a2"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # the runner and the proposer drop the finished requests' state
    _all_free(llm)

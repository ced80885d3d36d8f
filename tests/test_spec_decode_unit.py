"""Speculative decoding without a model: config, n-gram lookup, rejection sampler.

The rejection sampler is checked statistically against the target distribution
(fixed seeds): the emitted tokens' total-variation distance to ``p`` is within the
sampling noise, while a perturbed reference (or the draft ``q``) is far outside it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmserve.layers.sampler import build_sampling_metadata, make_generator
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode import SpecDecodingStats, SpeculativeConfig, ngram_propose
from llmserve.spec_decode.rejection_sampler import rejection_sample
from tests.test_spec_decode_goodput import measure_plain_steps

# ---------------------------------------------------------------- config


def test_config_defaults_and_inference():
    c = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.from_value({"model": "/x/draft.gguf", "num_speculative_tokens": 4})
    assert c.method == "draft_model" and c.needs_draft_probs
    assert SpeculativeConfig.from_value({"model": "ngram", "num_speculative_tokens": 1}).method \
        == "ngram"


@pytest.mark.parametrize("value, field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_length_policy": "x"},
     "draft_length_policy"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_vocab_size": 100},
     "draft_vocab_size"),
    ({"model": "/x/d.gguf", "num_speculative_tokens": 2, "draft_vocab_size": 0},
     "draft_vocab_size"),
    ("{not json", "JSON"),
])
def test_config_errors_name_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_value(value)


# ---------------------------------------------------------------- n-gram


def test_ngram_longest_then_latest_match():
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 7, 2, 3, 8, 1, 2, 3]
    # suffix "1 2 3" (n=3) matches at 0 -> proposes what followed: 9 7 2
    assert ngram_propose(tokens, 1, 3, 3) == [9, 7, 2]
    # n=2 only: "2 3" matches at 1 and 5; the latest (5) wins -> 8 1
    assert ngram_propose(tokens, 2, 2, 2) == [8, 1]
    # the context ends first: fewer than k tokens
    assert ngram_propose([4, 5, 6, 4, 5], 2, 2, 5) == [6, 4, 5]
    assert ngram_propose([1, 2, 3, 4], 1, 3, 4) == []  # no earlier occurrence
    assert ngram_propose([1, 2, 1], 1, 3, 0) == []
    assert ngram_propose([7], 1, 3, 2) == []


def test_stats_acceptance():
    s = SpecDecodingStats()
    s.observe(3, 2)
    s.observe(3, 0)
    s.observe(0, 0)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 6, 2)
    assert s.num_accepted_tokens_per_pos == [1, 1, 0]
    assert s.acceptance_rate == pytest.approx(1 / 3) and s.mean_acceptance_length == 2.0


# ---------------------------------------------------------------- rejection sampler


def _rows_metadata(params_per_req, ks, generators=None):
    rows, gens = [], []
    for i, (p, k) in enumerate(zip(params_per_req, ks)):
        rows += [p] * (k + 1)
        gens += [generators[i] if generators else None] * (k + 1)
    return build_sampling_metadata(rows, [[]] * len(rows), [[]] * len(rows), gens, set(), 8)


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def _simulate(p_rows, q_rows, n, one_hot_draft=None):
    """n independent requests with k = len(q_rows) drafts; returns first and second tokens."""
    k = len(p_rows) - 1
    v = p_rows.shape[1]
    if one_hot_draft is None:
        drafts = torch.stack([torch.multinomial(q_rows[j], n, replacement=True)
                              for j in range(k)], dim=1)  # [n, k]
        draft_probs = q_rows.repeat(n, 1)  # [n * k, V]
    else:
        drafts = torch.tensor(one_hot_draft).repeat(n, 1)
        draft_probs = None
    logits = torch.log(p_rows).repeat(n, 1)  # [n * (k + 1), V]
    meta = _rows_metadata([SamplingParams(temperature=1.0)] * n, [k] * n)
    out = rejection_sample(logits, meta, [k] * n, drafts.flatten(), draft_probs)
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=v).float()
    second = [o[1] for o, d in zip(out, drafts.tolist()) if o[0] == d[0]]
    return first, torch.bincount(torch.tensor(second), minlength=v).float(), drafts


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampler_matches_target_distribution(one_hot):
    torch.manual_seed(1234)
    v, n = 8, 40000
    p_rows = torch.softmax(torch.randn(3, v) * 1.5, dim=-1)
    q_rows = torch.softmax(torch.randn(2, v) * 1.5, dim=-1)
    first, second, _ = _simulate(p_rows, q_rows, n, one_hot_draft=p_rows[:2].argmax(-1).tolist() if one_hot else None)
    noise = 3.0 * (v / n) ** 0.5  # a loose bound on TV sampling noise at n samples
    assert _tv(first, p_rows[0]) < noise
    assert second.sum() > 2000
    assert _tv(second, p_rows[1]) < 3.0 * (v / second.sum()) ** 0.5
    # a wrong rule would land elsewhere: the test tells p from a perturbed p or from q
    perturbed = torch.softmax(torch.log(p_rows[0]) + 0.3 * torch.randn(v), dim=-1)
    assert _tv(first, perturbed) > 2 * noise
    if not one_hot:
        assert _tv(first, q_rows[0]) > 2 * noise


def test_rejection_sampler_wrong_rule_would_fail():
    """Resampling from p (not the residual) after a rejection biases the output; the
    same TV check rejects that rule, so the test above can fail."""
    torch.manual_seed(7)
    v, n = 8, 40000
    p = torch.softmax(torch.randn(v) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(v) * 1.5, dim=-1)
    x = torch.multinomial(q, n, replacement=True)
    accept = torch.rand(n) < (p[x] / q[x]).clamp(max=1)
    wrong = torch.where(accept, x, torch.multinomial(p, n, replacement=True))
    assert _tv(torch.bincount(wrong, minlength=v).float(), p) > 3.0 * (v / n) ** 0.5


def test_greedy_accepts_while_argmax_agrees():
    v = 8
    argmaxes = [2, 5, 1, 6]  # target argmax at rows 0..3 of a k=3 request
    logits = torch.full((4, v), -5.0)
    logits[torch.arange(4), torch.tensor(argmaxes)] = 5.0
    meta = _rows_metadata([SamplingParams(temperature=0.0)], [3])
    assert rejection_sample(logits, meta, [3], torch.tensor([2, 5, 1])) == [[2, 5, 1, 6]]
    assert rejection_sample(logits, meta, [3], torch.tensor([2, 4, 1])) == [[2, 5]]
    assert rejection_sample(logits, meta, [3], torch.tensor([0, 5, 1])) == [[2]]
    # mixed batch: a greedy request with no drafts next to a sampled one
    logits2 = torch.cat([logits[:1], torch.log(torch.full((3, v), 1.0 / v))])
    meta2 = _rows_metadata([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)],
                           [0, 2])
    out = rejection_sample(logits2, meta2, [0, 2], torch.tensor([1, 1]))
    assert out[0] == [2] and 1 <= len(out[1]) <= 3


def test_seeded_request_same_alone_or_batched():
    torch.manual_seed(0)
    v, k = 8, 3
    own = torch.randn(k + 1, v)
    drafts = torch.tensor([1, 2, 3])
    q = torch.softmax(torch.randn(k, v), dim=-1)
    sp = SamplingParams(temperature=0.8, top_k=6, seed=42)
    alone = rejection_sample(own, _rows_metadata([sp], [k], [make_generator(42)]), [k], drafts, q)
    other = SamplingParams(temperature=1.0)
    logits = torch.cat([torch.randn(3, v), own])
    meta = _rows_metadata([other, sp], [2, k], [None, make_generator(42)])
    batched = rejection_sample(logits, meta, [2, k], torch.cat([torch.tensor([0, 0]), drafts]),
                               torch.cat([torch.softmax(torch.randn(2, v), -1), q]))
    assert batched[1] == alone[0]


def test_rejection_sampler_shape_error():
    meta = _rows_metadata([SamplingParams(temperature=0.0)], [2])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(torch.zeros(2, 8), meta, [2], torch.tensor([1, 2]))


# ---------------------------------------------------------------- scheduler bookkeeping


def _scheduler(num_blocks=20, lookahead=0):
    from llmserve.config import SchedulerConfig
    from llmserve.kv_cache import KVCacheManager
    from llmserve.scheduler import Scheduler

    return Scheduler(SchedulerConfig(max_model_len=256, max_num_batched_tokens=64),
                     KVCacheManager(num_blocks, 4, enable_caching=True),
                     num_lookahead_tokens=lookahead)


def _request(rid, n_prompt=6, max_tokens=50, eos=(99,)):
    from llmserve.scheduler import Request

    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(temperature=0.0),
                   max_tokens, eos)


def test_scheduler_verifies_drafts_and_rolls_back_rejected_slots():
    from llmserve.scheduler import ModelRunnerOutput

    sched = _scheduler()
    req = _request("a")
    sched.add_request(req)
    out = sched.schedule()  # prefill: 6 tokens
    sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": 7},
                                                    spec_token_ids={"a": [8, 9, 10, 11]}))
    assert req.spec_token_ids == [8, 9, 10, 11] and req.num_computed_tokens == 6
    out = sched.schedule()  # the decode: last token + 4 drafts
    assert out.num_scheduled_tokens == {"a": 5}
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9, 10, 11]}
    kv = sched.kv_cache_manager
    assert len(kv.get_block_ids("a")) == 3  # 11 slots of 4
    # two drafts accepted, the third rejected and replaced by 42
    core = sched.update_from_output(out, ModelRunnerOutput(
        sampled_token_ids={"a": 42}, emitted_token_ids={"a": [8, 9, 42]}))
    assert core[0].new_token_ids == [8, 9, 42]
    assert req.output_token_ids == [7, 8, 9, 42]
    assert req.num_computed_tokens == 9 and req.num_tokens == 10  # 7, 8, 9 computed
    assert len(kv.get_block_ids("a")) == 3  # ceil(10 / 4): nothing to trim here
    # EOS inside a drafted run ends the request there and frees its blocks
    sched.update_from_output(sched.schedule(), ModelRunnerOutput(sampled_token_ids={"a": 5}))
    assert req.spec_token_ids == []
    req.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    core = sched.update_from_output(out, ModelRunnerOutput(
        sampled_token_ids={"a": 4}, emitted_token_ids={"a": [1, 99, 3, 4]}))
    assert core[0].new_token_ids == [1, 99] and core[0].finish_reason == "stop"
    assert kv.get_num_free_blocks() == kv.num_usable_blocks


def test_scheduler_trims_blocks_and_caps_drafts_at_max_tokens():
    from llmserve.scheduler import ModelRunnerOutput

    sched = _scheduler()
    req = _request("b", n_prompt=4, max_tokens=6)
    sched.add_request(req)
    sched.update_from_output(sched.schedule(), ModelRunnerOutput(
        sampled_token_ids={"b": 7}, spec_token_ids={"b": [1, 2, 3, 4, 5, 6, 7, 8]}))
    assert req.spec_token_ids == [1, 2, 3, 4]  # 1 + 4 + bonus = max_tokens 6
    out = sched.schedule()
    kv = sched.kv_cache_manager
    assert len(kv.get_block_ids("b")) == 3  # 4 + 5 slots
    sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"b": 9},
                                                    emitted_token_ids={"b": [9]}))
    assert req.num_computed_tokens == 5 and len(kv.get_block_ids("b")) == 2  # rolled back


def test_scheduler_allocates_lookahead_slots_for_a_draft_model():
    from llmserve.scheduler import ModelRunnerOutput

    sched = _scheduler(lookahead=3)
    req = _request("c", n_prompt=8)
    sched.add_request(req)
    out = sched.schedule()
    kv = sched.kv_cache_manager
    assert len(kv.get_block_ids("c")) == 3  # 8 prompt slots + 3 lookahead
    sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"c": 1}))
    sched.abort_requests("c")
    assert kv.get_num_free_blocks() == kv.num_usable_blocks


def test_draft_config_checks_name_the_field():
    from llmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from llmserve.spec_decode.draft_model import check_draft_config

    def mc(vocab, ctx):
        return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=8,
                           intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, max_position_embeddings=ctx)

    cfg = EngineConfig(model="t", model_config=mc(100, 512), cache_config=CacheConfig(),
                       scheduler_config=SchedulerConfig(max_model_len=512))
    check_draft_config(mc(100, 512), cfg)
    with pytest.raises(ValueError, match="speculative_config.model.*vocabulary"):
        check_draft_config(mc(120, 512), cfg)
    with pytest.raises(ValueError, match="speculative_config.model.*context length"):
        check_draft_config(mc(100, 256), cfg)
    big = dataclasses.replace(cfg, speculative_config=SpeculativeConfig(
        model="/x/d.gguf", num_speculative_tokens=2, draft_vocab_size=101))
    with pytest.raises(ValueError, match="draft_vocab_size.*exceeds"):
        check_draft_config(mc(100, 512), big)


def test_cli_flag_reaches_the_engine_config():
    import argparse

    from llmserve.config import ModelConfig
    from llmserve.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2, '
                              '"draft_length_policy": "adaptive"}', "--device", "cpu"])
    model = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=8,
                        intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, max_position_embeddings=64)
    cfg = EngineArgs.from_cli_args(args).create_engine_config(model, "m")
    assert cfg.speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=2, draft_length_policy="adaptive")


def test_adaptive_policy_follows_acceptance_and_batch():
    from llmserve.spec_decode.policy import DraftLengthPolicy

    fixed = DraftLengthPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=5))
    assert fixed.num_drafts("r", 200) == 5
    pol = DraftLengthPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=5,
                                              draft_length_policy="adaptive"))
    measure_plain_steps(pol, (1, 40, 64))
    for _ in range(10):
        pol.observe("good", 5, 5)
        pol.observe("bad", 3, 0)
    assert pol.num_drafts("good", 1) == 5
    assert pol.num_drafts("bad", 1) == 0
    assert pol.num_drafts("good", 64) == 0  # compute bound: no speculation
    assert 0 < pol.num_drafts("good", 40) < 5  # fewer drafts as the batch grows
    # a request with k = 0 still probes now and then
    assert max(pol.num_drafts("bad", 1) for _ in range(10)) == 1


def test_adaptive_policy_uses_measured_step_costs():
    """Once the engine has timed its own verification steps, the per-draft cost is the
    fitted cost of one more row (plus the draft forward) over a plain decode step."""
    from llmserve.spec_decode.policy import DraftLengthPolicy, StepCostModel

    model = StepCostModel()
    assert model.coefficients() is None
    for i in range(20):  # t = 0.040 + 0.020 * rows, rows 1..5
        rows = 1 + i % 5
        model.observe_step(rows, 0.040 + 0.020 * rows)
    a, b = model.coefficients()
    assert a == pytest.approx(0.040) and b == pytest.approx(0.020)
    assert model.relative_cost(1) is None  # no draft timing yet
    model.observe_draft(4, 0.0)  # n-gram: free proposals
    assert model.relative_cost(1) == pytest.approx(0.02 / 0.06)
    same_rows = StepCostModel()
    for _ in range(20):
        same_rows.observe_step(3, 0.1)
    assert same_rows.coefficients() is None  # b cannot be told from a
    # batches of 3-4 have a fit of their own: rows cost more there (compute bound)
    assert model.coefficients(4) is None and model.relative_cost(4) is None
    for i in range(20):  # t = 0.060 + 0.030 * rows, rows 4..20
        rows = 4 * (1 + i % 5)
        model.observe_step(rows, 0.060 + 0.030 * rows, batch_size=4)
        model.observe_draft(1, 0.010, batch_size=3)
    assert model.coefficients(3) == pytest.approx((0.060, 0.030))
    assert model.relative_cost(4) == pytest.approx((0.12 + 0.01) / 0.18)
    assert model.coefficients(1) == pytest.approx((0.040, 0.020))  # batch 1 unchanged
    # speculation turned off: 200 steps of 4 rows each, slower than the fit said; the
    # slope stays (no fallback to the priors), the intercept follows the step time
    for _ in range(200):
        model.observe_step(4, 0.200, batch_size=4)
    a4, b4 = model.coefficients(4)
    assert b4 == pytest.approx(0.030) and a4 + 4 * b4 == pytest.approx(0.200, rel=1e-3)
    # a batch of 16 has no fit: what batch 4 measured is its floor
    assert model.relative_cost(16) is None
    assert model.smaller_batch_cost(16) == pytest.approx(model.relative_cost(4))
    assert model.smaller_batch_cost(1) is None

    pol = DraftLengthPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                              draft_length_policy="adaptive"))
    measure_plain_steps(pol, (1, 4))
    for _ in range(10):
        pol.observe("r", 4, 1)  # alpha = 0.5
    assert pol.num_drafts("r", 1) == 3  # priors: a draft costs 0.12 of a step
    pol.cost_model = model  # measured: one more row costs a third of a step
    assert pol.num_drafts("r", 1) == 1  # 0.5 >= 1/3 > 0.25
    for _ in range(10):
        pol.observe("r", 4, 0)
    assert pol.num_drafts("r", 1) == 0
    for _ in range(30):
        pol.observe("r", 4, 4)
    assert pol.num_drafts("r", 1) == 4

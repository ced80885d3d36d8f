"""Sampler: each processing step against an independent oracle, seeded determinism,
sampling frequencies, min_tokens and logprobs. No model; runs in seconds on CPU."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from llmserve.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    build_sampling_metadata,
    make_generator,
)
from llmserve.sampling_params import SamplingParams

EOS = 2


def metadata_for(params, vocab, prompts=None, outputs=None, generators=None, eos=(EOS,),
                 device="cpu") -> SamplingMetadata:
    n = len(params)
    if generators is None:
        generators = [make_generator(p.seed, device) if p.seed is not None else None for p in params]
    return build_sampling_metadata(
        params, prompts or [[0]] * n, outputs or [[] for _ in range(n)], generators, set(eos),
        vocab, device)


def hf_warp(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Reference filtering of one row ``[V]`` with transformers' warpers, in vLLM's order."""
    scores = row.unsqueeze(0).clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.min_p > 0:
        warpers.append(MinPLogitsWarper(p.min_p))
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        warpers.append(TopPLogitsWarper(p.top_p))
    for w in warpers:
        scores = w(ids, scores)
    return scores[0]


def assert_same_filtering(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = ~torch.isinf(ref)
    torch.testing.assert_close(ours[finite], ref[finite], rtol=1e-6, atol=1e-6)


FILTER_CASES = [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.5),
    SamplingParams(temperature=0.5, min_p=0.05),
    SamplingParams(temperature=2.0, min_p=0.1, top_k=20, top_p=0.9),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.9, top_k=1),
]


@pytest.mark.parametrize("subset", [slice(None), slice(0, 1), slice(1, 2), slice(3, 4)])
def test_filters_match_transformers(subset):
    torch.manual_seed(0)
    params = FILTER_CASES[subset]
    vocab = 300
    logits = torch.randn(len(params), vocab) * 3
    meta = metadata_for(params, vocab)
    ours = apply_temperature(logits, meta.temperature)
    if meta.min_p is not None:
        ours = apply_min_p(ours, meta.min_p)
    ours = apply_top_k_top_p(ours, meta.top_k, meta.top_p)
    for i, p in enumerate(params):
        assert_same_filtering(ours[i], hf_warp(logits[i], p))


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(1)
    vocab = 64
    penalties = [1.3, 0.7, 1.0, 2.0]
    prompts = [[1, 5, 5, 9], [3], [4, 4], [10, 11, 12, 13, 14]]
    outputs = [[7, 1], [3, 8, 8], [], [63, 0]]
    logits = torch.randn(4, vocab)
    logits[0, 5] = 0.0
    meta = metadata_for([SamplingParams(repetition_penalty=r) for r in penalties], vocab,
                        prompts, outputs)
    assert not meta.no_penalties
    ours = apply_penalties(logits, meta.prompt_token_ids, outputs, meta.presence_penalties,
                           meta.frequency_penalties, meta.repetition_penalties)
    for i, r in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(r)(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(ours[i], ref, rtol=1e-6, atol=1e-6)


def test_frequency_and_presence_follow_openai_formula():
    torch.manual_seed(2)
    vocab = 32
    cases = [(0.5, 0.0), (0.0, 1.5), (-1.0, 2.0), (2.0, -0.5)]
    outputs = [[1, 1, 1, 4], [2, 2, 30], [5], [7, 7, 8, 9, 9, 9]]
    prompts = [[3, 4], [6], [5, 5], [31]]  # the prompt never counts for these two penalties
    logits = torch.randn(4, vocab)
    params = [SamplingParams(presence_penalty=pp, frequency_penalty=fp) for pp, fp in cases]
    meta = metadata_for(params, vocab, prompts, outputs)
    ours = apply_penalties(logits, meta.prompt_token_ids, outputs, meta.presence_penalties,
                           meta.frequency_penalties, meta.repetition_penalties)
    for i, (presence, frequency) in enumerate(cases):
        expected = logits[i].clone()
        for token, count in Counter(outputs[i]).items():
            expected[token] -= frequency * count + presence
        torch.testing.assert_close(ours[i], expected)


def test_greedy_rows_take_argmax_of_penalized_logits():
    vocab = 16
    logits = torch.zeros(3, vocab)
    logits[:, 5] = 2.0
    logits[:, 6] = 1.9
    outputs = [[5], [5], [5, 5]]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, frequency_penalty=0.1)]
    out = Sampler()(logits, metadata_for(params, vocab, outputs=outputs))
    assert out.sampled_token_ids.tolist() == [6, 5, 6]
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs is None


def test_logprobs_are_raw_log_softmax_and_rank_is_correct():
    torch.manual_seed(3)
    vocab = 100
    logits = torch.randn(4, vocab) * 2
    original = logits.clone()
    params = [SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.5),
              SamplingParams(temperature=1.5, logprobs=0, top_k=30),
              SamplingParams(temperature=0.8, top_p=0.7),
              SamplingParams(temperature=1.0, seed=7, logprobs=2, presence_penalty=1.0)]
    out = Sampler()(logits, metadata_for(params, vocab, outputs=[[1], [2], [3], [4, 5]]))
    assert torch.equal(logits, original)  # the input is not modified
    assert out.logprob_token_ids.shape == out.logprobs.shape == (4, 6)
    assert out.logprob_token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    reference = torch.log_softmax(original.double(), dim=-1)
    for i in range(4):
        sampled = int(out.sampled_token_ids[i])
        ids = out.logprob_token_ids[i].tolist()
        assert ids[0] == sampled
        assert ids[1:] == sorted(range(vocab), key=lambda t, i=i: -reference[i, t].item())[:5]
        torch.testing.assert_close(out.logprobs[i].double(), reference[i, ids], atol=1e-5, rtol=0)
        assert int(out.sampled_token_ranks[i]) == 1 + int((reference[i] > reference[i, sampled]).sum())


def test_seeded_row_does_not_depend_on_batch():
    vocab, steps = 200, 8
    torch.manual_seed(4)
    row_logits = [torch.randn(vocab) for _ in range(steps)]

    def generate(position: int, others: list[SamplingParams], seed: int = 1234) -> list[int]:
        seeded = SamplingParams(temperature=0.9, seed=seed, frequency_penalty=0.3)
        params = others[:position] + [seeded] + others[position:]
        generators = [make_generator(p.seed) if p.seed is not None else None for p in params]
        outputs: list[list[int]] = [[] for _ in params]
        sampler = Sampler()
        for step in range(steps):
            logits = torch.randn(len(params), vocab) * 2
            logits[position] = row_logits[step]
            meta = build_sampling_metadata(params, [[1, 2]] * len(params), outputs, generators,
                                           {EOS}, vocab)
            for row, token in enumerate(sampler(logits, meta).sampled_token_ids.tolist()):
                outputs[row].append(token)
        return outputs[position]

    alone = generate(0, [])
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.1, top_p=0.8),
              SamplingParams(temperature=0.7, seed=99, top_k=10, min_p=0.1, logprobs=3),
              SamplingParams(temperature=1.0, repetition_penalty=1.3)]
    assert generate(2, others) == alone
    assert generate(4, others) == alone
    assert generate(1, others[:2]) == alone
    assert len(set(alone)) > 1  # really sampled, not argmax
    assert generate(0, [], seed=4321) != alone


def expected_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    return torch.softmax(hf_warp(logits, p).double(), dim=-1)


def chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    kept = probs > 0
    expected = probs[kept] * n
    return float((((counts[kept] - expected) ** 2) / expected).sum())


FREQ_CASES = [SamplingParams(temperature=0.8, top_k=6, top_p=0.9),
              SamplingParams(temperature=1.2, top_p=0.75),
              SamplingParams(temperature=1.0, min_p=0.2),
              SamplingParams(temperature=0.7)]


@pytest.mark.parametrize("params", FREQ_CASES)
@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_frequencies_match_filtered_softmax(params, seeded):
    n, vocab = 4000, 10
    row = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.8, 0.5, 0.0, -0.5, -1.0, -3.0])
    probs = expected_probs(row, params)
    batch = [params.clone() for _ in range(n)]
    generators = [make_generator(1000 + i) if seeded else None for i in range(n)]
    meta = metadata_for(batch, vocab, generators=generators)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        sampled = Sampler()(row.expand(n, vocab), meta).sampled_token_ids
    counts = torch.bincount(sampled, minlength=vocab).double()
    assert counts[probs == 0].sum() == 0  # filtered tokens are never drawn
    # kept tokens <= 10, so df <= 9; P(chi2_9 > 40) ~ 7e-6
    assert chi_square(counts, probs, n) < 40


def test_top_k_one_is_always_the_argmax():
    torch.manual_seed(6)
    logits = torch.randn(64, 50)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 32 + [SamplingParams(top_p=1e-6)] * 32
    out = Sampler()(logits, metadata_for(params, 50))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_token_ids(temperature):
    vocab = 20
    logits = torch.zeros(4, vocab)
    logits[:, EOS] = 50.0
    logits[:, 7] = 40.0  # a stop token id
    logits[:, 11] = 30.0
    params = [SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[7]),
              SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[7, 400]),
              SamplingParams(temperature=temperature, min_tokens=3, ignore_eos=True),
              SamplingParams(temperature=temperature)]
    outputs = [[4], [4, 4, 4], [4, 4], [4]]
    sampled = Sampler()(logits, metadata_for(params, vocab, outputs=outputs)).sampled_token_ids
    # row 0 still below min_tokens: EOS and 7 blocked; row 1 reached it; row 2 blocks EOS (as vLLM)
    assert sampled.tolist() == [11, EOS, 7, EOS]


def test_build_metadata_fields():
    vocab = 50
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=80),
              SamplingParams(temperature=0.5, seed=1, logprobs=3)]
    meta = metadata_for(params, vocab, prompts=[[1, 2, 3], [4], [60, 5]])
    assert meta.temperature.tolist() == [0.0, 0.5, 0.5] and meta.temperature.dtype == torch.float32
    assert not meta.all_greedy and not meta.all_random
    assert meta.top_p is None and meta.top_k is None and meta.min_p is None  # top_k 80 >= vocab
    assert meta.no_penalties and meta.prompt_token_ids is None
    assert list(meta.generators) == [2] and meta.max_num_logprobs == 3 and meta.min_tokens == {}

    params = [SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.1, min_tokens=2,
                             stop_token_ids=[9, 70]), SamplingParams(temperature=0.5, top_p=0.5)]
    meta = metadata_for(params, vocab, prompts=[[1, 2, 3], [4]])
    assert meta.all_random and meta.top_k.tolist() == [5, vocab] and meta.top_k.dtype == torch.int64
    assert meta.top_p.tolist() == [1.0, 0.5]
    assert meta.prompt_token_ids.tolist() == [[1, 2, 3], [4, vocab, vocab]]
    assert meta.min_tokens == {0: (2, {EOS, 9})}  # ids >= vocab dropped
    assert metadata_for([SamplingParams(temperature=0)] * 2, vocab).all_greedy


def test_build_metadata_errors():
    seeded = SamplingParams(seed=3)
    with pytest.raises(ValueError, match="seed=3 but no generator"):
        build_sampling_metadata([seeded], [[1]], [[]], [None], {EOS}, 10)
    with pytest.raises(ValueError, match="same length"):
        build_sampling_metadata([seeded], [[1], [2]], [[]], [None], {EOS}, 10)


def test_all_greedy_does_not_consume_random_state():
    params = [SamplingParams(temperature=0.0)] * 3
    logits = torch.randn(3, 10)
    before = torch.random.get_rng_state()
    Sampler()(logits, metadata_for(params, 10))
    assert torch.equal(before, torch.random.get_rng_state())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixed_batch_on_cuda():
    vocab = 1000
    torch.manual_seed(8)
    logits = torch.randn(4, vocab, device="cuda") * 2
    params = [SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.2),
              SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=1.0, seed=11, min_tokens=2),
              SamplingParams(temperature=1.0, frequency_penalty=0.5)]
    outputs = [[1], [2], [3], [4]]
    out = Sampler()(logits, metadata_for(params, vocab, outputs=outputs, device="cuda"))
    assert out.sampled_token_ids.device.type == "cuda"
    alone = Sampler()(logits[2:3], metadata_for(params[2:3], vocab, outputs=outputs[2:3],
                                                device="cuda"))
    assert int(alone.sampled_token_ids[0]) == int(out.sampled_token_ids[2])
    cpu = Sampler()(logits.cpu(), metadata_for(params, vocab, outputs=outputs))
    assert int(cpu.sampled_token_ids[0]) == int(out.sampled_token_ids[0])  # greedy row
    torch.testing.assert_close(out.logprobs.cpu(), cpu.logprobs, atol=1e-4, rtol=0)

"""``SamplingParams(prompt_logprobs=k)`` offline against transformers' float32
log_softmax on the same GGUF weights: whole prefill, chunked prefill, batched with
other requests, and a prompt whose prefix is already in the prefix cache (vLLM bug
13105: cached positions must not come back with wrong or missing values)."""

from __future__ import annotations

import pytest

from tests.conftest import engine_variant

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.model

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and "
    "Berlin is the capital of Germany.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
]
ATOL = 2e-3  # float32 engine vs float32 transformers on the same dequantized weights
K = 4


@pytest.fixture(scope="module")
def prompt_ids(llm_fp32):
    tok = llm_fp32.get_tokenizer()
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def hf_prompt_logprobs(hf_model, prompt_ids):
    """transformers: log_softmax of the logits at position j, for prompt token j+1."""
    ref = []
    with torch.inference_mode():
        for ids in prompt_ids:
            logits = hf_model(torch.tensor([ids])).logits[0].float()
            ref.append(torch.log_softmax(logits, -1))  # [P, V]
    return ref


def _params(**kw):
    from llmserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K, **kw)


def _check(out, ids, ref):
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids)
    assert plp[0] is None
    for j in range(1, len(ids)):
        entry, row = plp[j], ref[j - 1]
        assert ids[j] in entry
        lp = entry[ids[j]]
        assert abs(lp.logprob - row[ids[j]].item()) < ATOL, (j, lp.logprob)
        assert lp.rank == int((row >= row[ids[j]]).sum())
        top = row.topk(K)
        assert set(top.indices.tolist()) <= set(entry)
        for tid, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[tid].logprob - v) < ATOL


def test_prompt_logprobs_match_transformers(llm_fp32, prompt_ids, hf_prompt_logprobs):
    outs = llm_fp32.generate([{"prompt_token_ids": ids} for ids in prompt_ids], _params(),
                             use_tqdm=False)
    for out, ids, ref in zip(outs, prompt_ids, hf_prompt_logprobs):
        _check(out, ids, ref)
        assert len(out.outputs[0].token_ids) == 2


def test_chunked_prefill_and_prefix_cache_hit(llm_fp32, prompt_ids, hf_prompt_logprobs):
    from llmserve import SamplingParams

    llm = engine_variant(llm_fp32, scheduler={"max_num_batched_tokens": 8},
                         cache={"block_size": 4})
    # warm the prefix cache with the same prompts (no prompt logprobs)
    llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                 SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    # batched with a plain request; every prompt is chunked over several steps
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids] + ["Hello there"]
    params = [_params(), _params(), SamplingParams(temperature=0.0, max_tokens=3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, ids, ref in zip(outs, prompt_ids, hf_prompt_logprobs):
        _check(out, ids, ref)
    assert outs[2].prompt_logprobs is None
    # the plain request still reads the cache; the greedy tokens are unchanged by it
    again = llm.generate([{"prompt_token_ids": prompt_ids[0]}], _params(), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    _check(again, prompt_ids[0], hf_prompt_logprobs[0])


def test_prompt_logprobs_range_is_checked():
    from llmserve import SamplingParams

    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)

"""KV quality harness (issue 15 item 5): teacher-forced decoding through the engine,
perplexity / KL / top-1 of KV dtypes and eviction policies against the full run.

Oracle: transformers on the same GGUF weights (dequantized, float32). The harness's
full-KV rows equal transformers' next-token log-probabilities on the same tokens; its
StreamingLLM rows equal transformers decoding the same tokens one at a time with its
KV cache pruned, before each step, to the positions StreamingLLM keeps (the sink block
and the most recent blocks, kept keys at their true positions): so the KL the harness
reports is the KL of the evicted cache, computed independently.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.engine.kv_quality import (
    KVVariant,
    build_engines,
    reference_logprobs,
    score_variant,
)
from llmserve.engine.teacher_forcing import teacher_forced

N, P, BLOCK, SINKS = 160, 96, 16, 4  # 64 rows; the prompt is 6 blocks


@pytest.fixture(scope="module")
def setup(gguf_path):
    engines = build_engines(gguf_path, ["int8"], N, dtype="float32", quantization="none")
    tok = engines["auto"].tokenizer
    text = ("The harbour town woke slowly. Fishing boats came in with the tide, gulls "
            "followed them, and the market opened its stalls one by one along the quay. ")
    ids = tok.encode(text * 12, add_special_tokens=False)[:N]
    assert len(ids) == N
    return engines, ids, reference_logprobs(engines["auto"], ids, P)


def _hf_streaming_logprobs(hf, ids, budget_blocks):
    """transformers' log-probabilities for rows 0 .. N-P-1 (predicting ids[P..]):
    the prompt in one pass, then one token per step with the cache pruned first to
    the sink block plus the ``budget_blocks - 1`` most recent blocks (the written one
    included), as StreamingLLM keeps them at block granularity."""
    rows = []
    with torch.no_grad():
        out = hf(torch.tensor([ids[:P]]), use_cache=True)
        cache = out.past_key_values
        rows.append(torch.log_softmax(out.logits[0, -1].double(), -1))
        held = list(range(P))  # true position of each cache slot
        for p in range(P, N - 1):
            cur = p // BLOCK
            keep_blocks = {0, *range(cur - budget_blocks + 2, cur + 1)}
            idx = [i for i, q in enumerate(held) if q // BLOCK in keep_blocks]
            if len(idx) < len(held):
                sel = torch.tensor(idx)
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, sel], layer.values[:, :, sel]
                held = [held[i] for i in idx]
            logits = hf(torch.tensor([[ids[p]]]), position_ids=torch.tensor([[p]]),
                        past_key_values=cache, cache_position=torch.tensor([len(held)]),
                        use_cache=True).logits
            rows.append(torch.log_softmax(logits[0, -1].double(), -1))
            held.append(p)
    return torch.stack(rows)


def test_full_kv_rows_equal_transformers(setup, hf_model):
    engines, ids, ref = setup
    with torch.no_grad():
        hf = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)
    assert ref.shape == (N - P, hf.shape[-1])
    torch.testing.assert_close(ref.double(), hf[P - 1:N - 1], atol=2e-3, rtol=0)
    # the same variant against itself: nothing but float32 rounding of the stored rows
    r = score_variant(engines["auto"], ids, P, KVVariant(), ref)
    assert r.kl_mean < 1e-6 and r.top1_agreement == 1.0
    assert r.num_tokens == N - P - 1 and r.first_row == 1
    assert r.perplexity == pytest.approx(r.reference_perplexity, rel=1e-5)


def test_streaming_llm_rows_and_kl_equal_transformers_on_the_pruned_cache(setup, hf_model):
    engines, ids, ref = setup
    budget = 64  # 4 blocks: the sink block + 3 recent
    rows = []
    run = teacher_forced(engines["auto"], ids, P,
                         lambda k, lg: rows.append(torch.log_softmax(lg.double(), -1)),
                         _sampling(budget), request_id="tf-stream")
    assert run.first_evicted_row() == 1 and max(run.num_kept_blocks[1:]) == budget // BLOCK
    ours = torch.stack(rows)
    hf_pruned = _hf_streaming_logprobs(hf_model, ids, budget // BLOCK)
    torch.testing.assert_close(ours, hf_pruned, atol=2e-3, rtol=0)

    # the harness's KL / perplexity equal those of transformers' full vs pruned rows
    r = score_variant(engines["auto"], ids, P,
                      KVVariant(policy="streaming_llm", budget_tokens=budget), ref)
    with torch.no_grad():
        full = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)
    full = full[P - 1:N - 1][1:]
    pruned = hf_pruned[1:]
    kl = (full.exp() * (full - pruned)).sum(-1)
    targets = torch.tensor(ids[P + 1:])
    ppl = math.exp(-float(pruned.gather(1, targets[:, None]).mean()))
    assert r.first_row == 1 and r.num_tokens == N - P - 1
    assert r.kl_mean == pytest.approx(float(kl.mean()), rel=0.02, abs=1e-4)
    assert r.kl_mean > 0.01  # eviction changed the predictions
    assert r.perplexity == pytest.approx(ppl, rel=1e-3)


def _sampling(budget):
    from llmserve.sampling_params import SamplingParams

    return SamplingParams(kv_eviction_policy="streaming_llm", kv_budget_tokens=budget,
                          num_sink_tokens=SINKS)


def test_kv_dtype_and_budget_ordering(setup):
    engines, ids, ref = setup
    int8 = score_variant(engines["int8"], ids, P, KVVariant("int8"), ref)
    assert 0 < int8.kl_mean < 0.05 and int8.top1_agreement >= 0.8
    small = score_variant(engines["auto"], ids, P,
                          KVVariant(policy="streaming_llm", budget_tokens=48), ref)
    large = score_variant(engines["auto"], ids, P,
                          KVVariant(policy="streaming_llm", budget_tokens=96), ref)
    assert small.max_kept_blocks == 3 and large.max_kept_blocks == 6
    assert small.kl_mean > large.kl_mean > int8.kl_mean
    for policy in ("h2o", "snapkv"):  # every policy evicts from the first decode step
        r = score_variant(engines["auto"], ids, P, KVVariant(policy=policy,
                                                             budget_tokens=96), ref)
        assert r.first_row == 1 and r.max_kept_blocks <= 6 and r.kl_mean > 0


def test_teacher_forced_refuses_bad_input(setup):
    engines, ids, _ = setup
    from llmserve.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="prompt_len"):
        teacher_forced(engines["auto"], ids, len(ids), lambda k, lg: None)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        teacher_forced(engines["auto"], ids, P, lambda k, lg: None,
                       SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="nothing was evicted"):
        score_variant(engines["auto"], ids[:40], 20,
                      KVVariant(policy="streaming_llm", budget_tokens=64),
                      reference_logprobs(engines["auto"], ids[:40], 20))


def test_eval_cli_kv_variants(gguf_path, capsys):
    import json

    from llmserve.entrypoints.cli import main

    argv = ["eval", gguf_path, "--dataset", "en", "--num-tokens", "96", "--prompt-tokens",
            "64", "--kv-cache-dtype", "fp8_e4m3", "--kv-eviction-policy", "streaming_llm",
            "--kv-budget-tokens", "48,64", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["variant"] for r in out] == ["kv-fp8_e4m3", "streaming_llm@48",
                                           "streaming_llm@64"]
    assert all(r["num_tokens"] == 31 and r["kl_mean"] > 0 for r in out)
    assert [r["max_kept_blocks"] for r in out] == [6, 3, 4]  # full: positions 0..94
    assert main([*argv[:-2], "x", "--json"]) == 2  # a non-integer budget
    assert "--kv-budget-tokens" in capsys.readouterr().err

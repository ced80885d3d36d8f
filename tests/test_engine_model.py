"""The engine on the real default model (SmolLM2-135M-Instruct Q4_1 GGUF) against
transformers on the same GGUF (dequantized, float32) as the oracle.

Greedy tokens must be identical; logprobs close (absolute tolerance
LOGPROB_ATOL on the natural-log probability of each of the top-5 tokens).
Batching, chunked prefill and preemption must not change greedy outputs.
"""

from __future__ import annotations

import pytest

from tests.conftest import engine_variant

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.model

NEW_TOKENS = 64
LOGPROB_ATOL = 2e-3
LONG_PARAGRAPH = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring plugboards; then came stored programs, assemblers, compilers and operating "
    "systems, each layer hiding the one below it. ")


def _prompts(tokenizer):
    from llmserve.tokenizer import apply_chat_template

    long_text = LONG_PARAGRAPH * 30
    long_ids = tokenizer.encode(long_text)[:1000]
    chat_ids = apply_chat_template(
        tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    return {
        "english": tokenizer.encode("The three most important inventions of the last century are"),
        "chinese": tokenizer.encode("请用中文介绍一下长城的历史。长城"),
        "code": tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        "chat": chat_ids,
        "one_token": tokenizer.encode("Hello")[:1],
        "long": long_ids,
    }


@pytest.fixture(scope="module")
def prompts(llm_fp32):
    p = _prompts(llm_fp32.get_tokenizer())
    assert len(p["one_token"]) == 1 and len(p["long"]) == 1000
    return p


@pytest.fixture(scope="module")
def hf_reference(hf_model, prompts):
    """transformers greedy generation: token ids and raw-logit log-softmax per step."""
    model = hf_model
    ref = {}
    with torch.inference_mode():
        for name, ids in prompts.items():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                return_dict_in_generate=True)
            tokens = out.sequences[0, len(ids):].tolist()
            logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
            ref[name] = (tokens, logprobs)
    return ref


def _greedy(max_tokens=NEW_TOKENS, **kw):
    from llmserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _run(llm, prompts, **kw):
    names = list(prompts)
    outs = llm.generate([{"prompt_token_ids": prompts[n]} for n in names], _greedy(**kw),
                        use_tqdm=False)
    return {n: o for n, o in zip(names, outs)}


def _assert_all_blocks_free(llm):
    mgr = llm.engine.scheduler.kv_cache_manager
    assert mgr.get_num_free_blocks() == mgr.num_usable_blocks
    assert not llm.engine.scheduler.requests


def test_greedy_tokens_and_logprobs_match_transformers(llm_fp32, prompts, hf_reference):
    outs = _run(llm_fp32, prompts, logprobs=5)
    for name, out in outs.items():
        ref_tokens, ref_logprobs = hf_reference[name]
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens, f"{name}: greedy tokens differ from transformers"
        assert comp.finish_reason == "length"
        assert len(comp.logprobs) == NEW_TOKENS
        for step, entry in enumerate(comp.logprobs):
            assert len(entry) >= 5
            for tid, lp in entry.items():
                ref = ref_logprobs[step][tid].item()
                assert abs(lp.logprob - ref) < LOGPROB_ATOL, (name, step, tid, lp.logprob, ref)
            # the sampled (greedy) token is rank 1
            assert entry[comp.token_ids[step]].rank == 1
        # a character cut by max_tokens is withheld, never emitted as U+FFFD
        full = llm_fp32.get_tokenizer().decode(comp.token_ids, skip_special_tokens=True)
        assert "\ufffd" not in comp.text
        assert comp.text == full.rstrip("\ufffd")
    _assert_all_blocks_free(llm_fp32)


def test_same_outputs_alone(llm_fp32, prompts, hf_reference):
    for name, ids in prompts.items():
        out = _run(llm_fp32, {name: ids})[name]
        assert out.outputs[0].token_ids == hf_reference[name][0], name
    _assert_all_blocks_free(llm_fp32)


def test_same_outputs_with_chunked_prefill(llm_fp32, prompts, hf_reference):
    llm = engine_variant(llm_fp32, scheduler={"max_num_batched_tokens": 48})
    outs = _run(llm, prompts)
    for name, out in outs.items():
        assert out.outputs[0].token_ids == hf_reference[name][0], name
    _assert_all_blocks_free(llm)


def test_same_outputs_under_preemption(llm_fp32, prompts, hf_reference):
    # 1,064 tokens for the long prompt alone; 80 blocks of 16 = 1,280 slots for all six
    llm = engine_variant(llm_fp32, cache={"num_gpu_blocks_override": 81},
                         scheduler={"max_model_len": 1280})
    outs = _run(llm, prompts)
    assert llm.engine.scheduler.stats.num_preemptions_total > 0
    for name, out in outs.items():
        assert out.outputs[0].token_ids == hf_reference[name][0], name
    _assert_all_blocks_free(llm)


def test_blocks_freed_after_abort(llm_fp32):
    eng = llm_fp32.engine
    for i in range(3):
        eng.add_request(f"abort-{i}", "Tell me a long story about a dragon.", _greedy(200))
    for _ in range(5):
        eng.step()
    assert eng.scheduler.kv_cache_manager.usage > 0
    eng.abort_request([f"abort-{i}" for i in range(3)])
    _assert_all_blocks_free(llm_fp32)
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize("bad,field", [
    ({"prompt": ""}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"prompt": "x " * 9000}, "max_model_len"),
    ({"prompt": "ab\udc00cd"}, "prompt is not valid Unicode"),
    ({"stop_token_ids": [49152]}, "stop_token_ids"),
])
def test_bad_input_is_a_value_error_and_engine_keeps_serving(llm_fp32, bad, field):
    from llmserve import SamplingParams

    prompt = bad.pop("prompt", "Hello")
    with pytest.raises(ValueError, match=field):
        llm_fp32.generate(prompt, SamplingParams(**bad) if bad else _greedy(4), use_tqdm=False)
    out = llm_fp32.generate("The capital of France is", _greedy(4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    _assert_all_blocks_free(llm_fp32)


def test_planner_block_count_equals_running_engine(llm_fp32, gguf_path):
    """`llmserve plan` reads the GGUF on its own (no torch) and must size the KV
    pool exactly as the running engine did under the same budget."""
    from llmserve.planner import kv_cache_bytes_per_token, load_gguf, num_kv_cache_blocks

    planned = load_gguf(gguf_path).model
    per_token = kv_cache_bytes_per_token(planned, "float32")
    assert per_token == 2 * 30 * 3 * 64 * 4 == llm_fp32.engine.kv_bytes_per_token
    budget = llm_fp32.engine.config.cache_config.kv_cache_memory
    assert budget == 256 * 1024**2
    assert num_kv_cache_blocks(budget, 16, per_token) == llm_fp32.engine.num_blocks

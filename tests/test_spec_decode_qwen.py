"""Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct (one tokenizer):
greedy tokens with the draft equal the target's own greedy tokens, in the default
format (bfloat16, native GGUF kernels), on one short prompt."""

from __future__ import annotations

import dataclasses

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.llm_engine import LLMEngine
from llmserve.spec_decode import SpeculativeConfig
from llmserve.spec_decode.draft_model import load_draft_model

pytestmark = [pytest.mark.model, pytest.mark.real_model]

PROMPT = "<|im_start|>user\nWrite a Python function is_prime(n).<|im_end|>\n<|im_start|>assistant\n"


def test_qwen05_draft_for_qwen15_is_lossless(qwen05_gguf, qwen15_gguf):
    base = LLM(model=qwen15_gguf, kv_cache_memory="64MiB", max_model_len=512)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = base.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].token_ids
    cfg = dataclasses.replace(base.engine.config, speculative_config=SpeculativeConfig(
        method="draft_model", model=qwen05_gguf, num_speculative_tokens=4))
    draft = load_draft_model(cfg, base.engine.tokenizer)
    assert draft.config.num_hidden_layers == 24 and draft.config.vocab_size == 151936
    llm = LLM.from_engine(LLMEngine(cfg, base.engine.tokenizer, base.engine.runner.model,
                                    draft_model=draft))
    got = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert got == ref
    stats = llm.engine.spec_decoding_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    print(f"qwen05 -> qwen15: {stats.log_line()}")
    mgr = llm.engine.scheduler.kv_cache_manager
    assert mgr.get_num_free_blocks() == mgr.num_usable_blocks

"""Sliding-window layers free their blocks (issue 15, item 3).

A small random-weight Mistral (every layer windowed) saved as safetensors runs a
context over 4x its window in a KV pool sized for the window (far too small for the
whole sequence): the blocks that slid out are returned at once, every step stays
within the cap, every block is free at the end, and the greedy tokens equal
transformers' on the same weights (fp32). Gemma-3-style mixed models free nothing
(a global layer still reads every block): checked on the limiter itself.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from llmserve.kv_cache import KVCacheManager
from llmserve.scheduler.kv_limits import KVLimiter
from llmserve.utils import cdiv

WINDOW, BLOCK, CHUNK = 16, 4, 8
VOCAB = 4096
PROMPT, NEW = 40, 32  # 72 tokens: 4.5 windows


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, gguf_path):
    from llmserve.loader import resolve_model
    from llmserve.tokenizer import load_tokenizer

    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        sliding_window=WINDOW, rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=None,
        eos_token_id=None)
    cfg.architectures = ["MistralForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("mistral_sw")
    hf.save_pretrained(path)
    load_tokenizer(resolve_model(gguf_path)).save_pretrained(path)
    return hf, str(path)


def test_window_longer_than_pool_matches_transformers(mistral_dir):
    from llmserve import LLM, SamplingParams

    hf, path = mistral_dir
    cap = cdiv(WINDOW + CHUNK, BLOCK) + 1  # KVLimiter.max_blocks
    assert cdiv(PROMPT + NEW, BLOCK) > cap + 6  # the whole sequence would not fit
    llm = LLM(path, dtype="float32", block_size=BLOCK, num_gpu_blocks_override=cap + 1,
              max_num_batched_tokens=CHUNK, enable_prefix_caching=True)
    engine = llm.engine
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_usable_blocks == cap
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=g).tolist()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False)[0, PROMPT:].tolist()
    engine.add_request("a", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    tokens, peak, freed = [], 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        peak = max(peak, kv.num_usable_blocks - kv.get_num_free_blocks())
        freed = max(freed, kv.num_evicted_tokens.get("a", 0))
    assert tokens == ref
    assert peak <= cap and freed >= PROMPT  # blocks slid out and came back to the pool
    assert kv.get_num_free_blocks() == kv.num_usable_blocks  # all free at the end
    # the same prompt again: the prefix cache serves only blocks cached before any freeing
    # (their KV is exactly the full prefix's), and the tokens are the same
    assert llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)[0].outputs[0] \
        .token_ids == ref


def test_window_rule_and_mixed_models_free_nothing():
    from llmserve.sampling_params import SamplingParams
    from llmserve.scheduler import Request

    kv = KVCacheManager(64, BLOCK)
    limiter = KVLimiter(kv, WINDOW)
    req = Request("r", list(range(40)), SamplingParams(), 8)
    kv.allocate_slots("r", 0, 40)
    req.num_computed_tokens = 40  # next query at 40 sees keys 25..40: blocks 0..5 dead
    limiter.before_allocate(req, 1)
    assert kv.num_evicted_tokens["r"] == 24 and len(kv.get_block_ids("r")) == 4
    # positions 24..39 stay (blocks 6..9)
    assert (40 - WINDOW + 1) // BLOCK * BLOCK == 24
    # no window (a global layer reads everything): nothing is freed
    kv2 = KVCacheManager(64, BLOCK)
    kv2.allocate_slots("r", 0, 40)
    KVLimiter(kv2, None).before_allocate(req, 1)
    assert len(kv2.get_block_ids("r")) == 10
    with pytest.raises(ValueError, match="sliding window"):
        KVLimiter(kv, WINDOW, "streaming_llm", 64)

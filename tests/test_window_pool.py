"""Mixed models free their local layers' blocks (issue 15, item 3): the window pool.

A small random-weight Gemma 3 (sliding, full, sliding, sliding) and a Qwen2 with
``max_window_layers`` (the Llama layers) run contexts over 4x their window with
prefix caching off: the local layers keep their KV in a second pool whose blocks slide
out (``kv_cache/window_blocks.py``). Greedy tokens equal transformers' on the same
weights (fp32), batched with chunked prefill, on both attention backends; each
sequence's window blocks stay within the cap, every block is free at the end, and the
paged pool costs only the global layers' bytes per token.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from llmserve.kv_cache import KVCacheManager
from llmserve.kv_cache.window_blocks import WindowBlocks, window_kv_layout
from llmserve.utils import cdiv

WINDOW, BLOCK, CHUNK = 8, 4, 8
VOCAB = 4096
PROMPTS, NEW = (40, 23, 31), 24  # 64 tokens: 8 windows


# ---------------------------------------------------------------- bookkeeping, no model
def test_window_blocks_slide_and_come_back():
    wb = WindowBlocks(64, BLOCK, WINDOW)
    kv = KVCacheManager(64, BLOCK, window_blocks=wb)
    cap = cdiv(WINDOW + CHUNK, BLOCK) + 1
    computed, peak = 0, 0
    for step in [CHUNK] * 5 + [1] * 30:  # a 40-token prompt in chunks, then 30 decodes
        assert kv.allocate_slots("r", computed, step) is not None
        first, ids = kv.get_window_blocks("r")
        # every key a query of this step reads (k > computed - W) is held, nothing older
        assert first == max(0, computed - WINDOW + 1) // BLOCK
        assert first + len(ids) == cdiv(computed + step, BLOCK)
        peak = max(peak, len(ids))
        computed += step
    assert peak <= cap and len(kv.get_block_ids("r")) == cdiv(computed, BLOCK)
    kv.free("r")
    assert wb.num_held() == 0 and kv.get_num_free_blocks() == kv.num_usable_blocks


def test_window_pool_full_changes_nothing_and_misuse_is_an_error():
    wb = WindowBlocks(4, BLOCK, WINDOW)  # 3 usable window blocks
    kv = KVCacheManager(64, BLOCK, window_blocks=wb)
    assert kv.allocate_slots("a", 0, 12) is not None  # 3 window blocks
    free = kv.get_num_free_blocks()
    assert kv.allocate_slots("b", 0, 4) is None  # no window block left: nothing changes
    assert kv.get_num_free_blocks() == free and kv.get_block_ids("b") == []
    assert kv.allocate_slots("a", 12, 4) is not None  # block 0 slid out: reused
    with pytest.raises(RuntimeError, match="no window blocks"):
        wb.can_allocate("c", 8, 1)  # computed tokens without a table (a prefix hit)
    with pytest.raises(ValueError, match="window pool"):
        kv.fork("a", "d", 8)


def test_layout_only_for_mixed_models_without_conflicts():
    mixed = [WINDOW, None, WINDOW, WINDOW]
    layout, why = window_kv_layout(mixed, BLOCK, 4, CHUNK, [])
    assert why == "" and layout.layers == (0, 2, 3) and layout.window == WINDOW
    assert layout.blocks_per_seq == cdiv(WINDOW + CHUNK, BLOCK) + 1
    assert layout.num_blocks >= 4 * (cdiv(WINDOW, BLOCK) + 2) + cdiv(CHUNK, BLOCK)
    assert window_kv_layout([WINDOW] * 4, BLOCK, 4, CHUNK, []) == (None, "")
    assert window_kv_layout([None] * 4, BLOCK, 4, CHUNK, []) == (None, "")
    none, why = window_kv_layout(mixed, BLOCK, 4, CHUNK, ["prefix caching"])
    assert none is None and "prefix caching" in why
    none, why = window_kv_layout([4, None, 8], BLOCK, 4, CHUNK, [])
    assert none is None and "different windows" in why


# ---------------------------------------------------------------- engine vs transformers
def _random_model(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                  max_position_embeddings=256, pad_token_id=None, bos_token_id=None,
                  eos_token_id=None, sliding_window=WINDOW)
    if kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **common, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                         "sliding_attention"])
        cls = transformers.Gemma3ForCausalLM
    else:  # Qwen2: layers >= max_window_layers slide
        cfg = transformers.Qwen2Config(**common, num_hidden_layers=3,
                                       use_sliding_window=True, max_window_layers=1)
        cls = transformers.Qwen2ForCausalLM
    cfg.architectures = [cls.__name__]
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            centre = 0 if kind == "gemma3" else 1
            p.copy_(centre + 0.1 * torch.randn_like(p) if "norm" in name
                    else 0.2 * torch.randn_like(p))
    hf.generation_config.eos_token_id = None
    return hf


@pytest.fixture(scope="module", params=["gemma3", "qwen2"])
def mixed_dir(request, tmp_path_factory, gguf_path):
    from llmserve.loader import resolve_model
    from llmserve.tokenizer import load_tokenizer

    hf = _random_model(request.param)
    path = tmp_path_factory.mktemp(f"{request.param}_mixed")
    hf.save_pretrained(path)
    load_tokenizer(resolve_model(gguf_path)).save_pretrained(path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPTS]
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                           do_sample=False)[0, len(p):].tolist() for p in prompts]
    return request.param, hf, str(path), prompts, ref


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_mixed_model_matches_transformers_in_a_window_pool(mixed_dir, backend):
    from llmserve import LLM, SamplingParams

    kind, hf, path, prompts, ref = mixed_dir
    llm = LLM(path, dtype="float32", block_size=BLOCK, max_num_batched_tokens=CHUNK,
              max_num_seqs=4, enable_prefix_caching=False, kv_cache_memory="4MiB",
              attention_backend=backend)
    engine = llm.engine
    kv = engine.scheduler.kv_cache_manager
    layout = engine.window_kv
    num_layers = hf.config.num_hidden_layers
    assert layout is not None and layout.window == WINDOW
    per_layer = 2 * 2 * 16 * 4  # K+V x 2 KV heads x head_dim 16 x fp32
    # the paged pool pays only for the global layers
    assert engine.kv_bytes_per_token == per_layer * (num_layers - len(layout.layers))
    runner = engine.runner
    for i, (kc, _) in enumerate(runner.kv_caches):
        assert kc.shape[0] == (layout.num_blocks if i in layout.layers else engine.num_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    tokens, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        for rid in map(str, range(len(prompts))):
            peak = max(peak, len(kv.get_window_blocks(rid)[1]))
    assert [tokens[str(i)] for i in range(len(prompts))] == ref
    assert peak <= layout.blocks_per_seq
    assert max(PROMPTS) + NEW >= 4 * WINDOW
    assert kv.window_blocks.num_held() == 0  # all free at the end
    assert kv.get_num_free_blocks() == kv.num_usable_blocks


def test_prefix_caching_keeps_one_pool(mixed_dir):
    from llmserve import LLM, SamplingParams

    _, _, path, prompts, ref = mixed_dir
    llm = LLM(path, dtype="float32", block_size=BLOCK, max_num_batched_tokens=CHUNK,
              kv_cache_memory="4MiB")
    assert llm.engine.window_kv is None
    assert llm.engine.scheduler.kv_cache_manager.window_blocks is None
    out = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == ref[0]


@pytest.mark.parametrize("key_quant", ["per-token", "per-channel"])
def test_int8_pages_in_the_window_pool_match_one_pool(mixed_dir, key_quant):
    """int8 KV (per-token scales, or KIVI's per-channel keys whose scales live in each
    block): the window pool's blocks hold the same logical blocks as one pool's, so the
    tokens are the same as with every layer in one pool. (A window-pool step skips the
    fused C decode path of plain Llama layers; it is turned off in the one-pool engine
    too, since its int8 rounding differs and random weights have near-ties.)"""
    from llmserve import LLM, SamplingParams

    _, _, path, prompts, _ = mixed_dir
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = []
    for caching in (False, True):
        llm = LLM(path, dtype="float32", block_size=BLOCK, max_num_batched_tokens=CHUNK,
                  max_num_seqs=4, enable_prefix_caching=caching, kv_cache_memory="4MiB",
                  kv_cache_dtype="int8", kv_key_quant=key_quant)
        assert (llm.engine.window_kv is None) == caching
        model = llm.engine.runner.model
        getattr(model, "model", model).use_cpu_decode_path = False
        outs.append([list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)])
    assert outs[0] == outs[1]


def test_deterministic_mode_reads_the_window_pool(mixed_dir):
    """``--deterministic`` runs every token as a one-token decode: the window table is
    expanded per token like the block table (ModelRunner._prepare_inputs)."""
    from llmserve import LLM, SamplingParams

    _, _, path, prompts, ref = mixed_dir
    llm = LLM(path, dtype="float32", block_size=BLOCK, max_num_batched_tokens=CHUNK,
              max_num_seqs=4, enable_prefix_caching=False, kv_cache_memory="4MiB",
              deterministic=True)
    assert llm.engine.window_kv is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == ref

"""``--deterministic`` on every architecture family, dense bfloat16 (issue 20).

The default model (Llama, packed GGUF weights) is covered in test_batch_invariance.py.
Here each other family -- Qwen3 (QK-norm, per-layer windows), Gemma 3 (sandwich norms,
sliding/global layers), Phi-3 (fused qkv/gate_up, the Llama decode path), Mixtral,
Qwen2-MoE (shared expert) and Qwen3-MoE -- is a random-weight model from transformers,
saved as safetensors and served in dense bfloat16, wide enough (hidden 512, MLP 1536)
that oneDNN's GEMM picks different kernels for different row counts. The oracle is the
engine with each prompt alone (its own cache salt, prompts chunked by a 32-token budget):
batched, arriving one per step beside running decodes, and behind prefix-cache hits,
every request must give the same token ids and logprobs, bit for bit.

Before MoE experts took ``chunked_linear`` (an expert's row count is the number of
tokens routed to it), Mixtral diverged on 3 of 16 prompts here. Outside
``--deterministic`` dense bfloat16 checkpoints are not batch-invariant (as in vLLM's
default mode): Qwen3 gave 7 of 16 prompts other logprobs batched (measured on an AMD
EPYC host, where an M = 1 GEMV and larger GEMMs round differently).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.test_arch_models import make_hf_model
from tests.test_batch_invariance import _alone, _diverging, _run
from tests.test_moe_model import SMALL as MOE_SMALL
from tests.test_moe_model import VARIANTS as MOE_VARIANTS
from tests.test_moe_model import save_word_tokenizer

VOCAB = 128  # the word tokenizer's ids (save_word_tokenizer)
WIDE = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=64)
DENSE = {
    "qwen3": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 16}),
    "gemma3": {},
    "phi3": dict(max_position_embeddings=64, original_max_position_embeddings=32,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5,
                                  "short_factor": [1.0] * 16, "long_factor": [2.0] * 16}),
}
MOE_WIDE = dict(moe_intermediate_size=768, shared_expert_intermediate_size=1024)


def _build(variant: str, path: str) -> None:
    if variant in DENSE:
        hf_model = make_hf_model(variant, **{**WIDE, **DENSE[variant]}, vocab_size=VOCAB,
                                 pad_token_id=None, bos_token_id=None, eos_token_id=None)
    else:
        cls, extra = MOE_VARIANTS[variant]
        extra = {**extra, **{k: v for k, v in MOE_WIDE.items() if k in extra}}
        config = getattr(transformers, f"{cls}Config")(**{**MOE_SMALL, **WIDE, **extra})
        torch.manual_seed(0)
        hf_model = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
        with torch.no_grad():
            for name, p in hf_model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name
                        else 0.05 * torch.randn_like(p))
    hf_model.save_pretrained(path)
    save_word_tokenizer(path)


def _prompts() -> list[dict]:
    """16 token-id prompts of 3..48 tokens; the odd ones start with the same 32 tokens
    (two full KV blocks: prefix-cache hits once one of them has run)."""
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, VOCAB - 1, (32,), generator=gen).tolist()
    prompts = []
    for i, n in enumerate((3, 9, 16, 12, 5, 1, 14, 7, 10, 15, 2, 11, 13, 4, 6, 8)):
        tail = torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist()
        prompts.append({"prompt_token_ids": prefix + tail if i % 2 else tail})
    return prompts


@pytest.mark.parametrize("variant", [*DENSE, *MOE_VARIANTS])
def test_deterministic_mode_dense_bf16_ignores_batch_and_prefix_cache(variant, tmp_path):
    from llmserve import LLM

    _build(variant, str(tmp_path))
    llm = LLM(model=str(tmp_path), dtype="bfloat16", kv_cache_memory="8MiB",
              deterministic=True, max_num_batched_tokens=32)
    engine = llm.engine
    assert engine.config.deterministic and engine.config.cache_config.enable_prefix_caching
    prompts = _prompts()
    cached_alone, cached_batched, cached_staggered = [], [], []
    alone = _alone(engine, prompts, salted=True, cached=cached_alone)
    assert _diverging(_run(engine, prompts, cached=cached_batched), alone) == []
    assert _diverging(_run(engine, prompts, stagger=True, cached=cached_staggered), alone) == []
    assert sum(cached_alone) == 0 and sum(cached_batched) > 0
    assert min(cached_staggered[1::2]) >= 32  # the shared prefix's two blocks

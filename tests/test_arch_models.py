"""Qwen3, Gemma 3 and Phi-3 against Hugging Face transformers on small random models.

Model level: every position's logits over a paged, chunked, mixed schedule (both
attention backends) match transformers run on each full sequence. Engine level:
the model saved as a safetensors directory (with the default model's tokenizer)
and served by :class:`llmserve.LLM` gives transformers' greedy tokens, alone and
batched with chunked prefill.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from llmserve.config import ModelConfig
from llmserve.models import get_model_class
from tests.test_llama_model import DECODES, MIXED, hf_logits, random_seqs, run_schedule

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5)

VARIANTS = {
    # QK-norm, explicit head_dim != hidden / heads, sliding window on layers >= 1, yarn
    "qwen3": (transformers.Qwen3Config, dict(
        num_hidden_layers=3, head_dim=32, max_position_embeddings=32, use_sliding_window=True,
        sliding_window=5, max_window_layers=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 8})),
    "qwen3_tied_bias": (transformers.Qwen3Config, dict(
        num_hidden_layers=2, tie_word_embeddings=True, attention_bias=True,
        max_position_embeddings=64)),
    # sliding, global, sliding (pattern 2); own RoPE bases; linear scaling on global layers
    "gemma3": (transformers.Gemma3TextConfig, dict(
        num_hidden_layers=3, head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
        max_position_embeddings=64, final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
    # fused qkv / gate_up, half the head rotates, longrope (sequences here stay below the
    # original context: short factors; the engine test crosses it), window on every layer
    "phi3": (transformers.Phi3Config, dict(
        num_hidden_layers=2, max_position_embeddings=128, original_max_position_embeddings=32,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
        partial_rotary_factor=0.5, sliding_window=6,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.3, 1.7, 2.2],
                         "long_factor": [1.5, 3.0, 6.0, 9.0]})),
}
ARCH = {transformers.Qwen3Config: "Qwen3ForCausalLM",
        transformers.Gemma3TextConfig: "Gemma3ForCausalLM",
        transformers.Phi3Config: "Phi3ForCausalLM"}


def make_hf_model(variant: str, **overrides):
    config_cls, extra = VARIANTS[variant]
    hf_config = config_cls(**{**SMALL, **extra, **overrides})
    hf_config.architectures = [ARCH[config_cls]]
    torch.manual_seed(0)
    hf_model = getattr(transformers, ARCH[config_cls])(hf_config).eval()
    gemma = config_cls is transformers.Gemma3TextConfig
    with torch.no_grad():  # random norms and biases too, so every weight matters
        for name, p in hf_model.named_parameters():
            if "norm" in name:  # Gemma norms are zero-centred (1 + w)
                p.copy_((0 if gemma else 1) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return hf_model


def our_config(hf_model) -> ModelConfig:
    """Our config parsed from the HF config's own ``config.json`` dict."""
    return ModelConfig.from_hf_config(hf_model.config.to_dict())


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers_fp32(variant, backend):
    hf_model = make_hf_model(variant)
    config = our_config(hf_model)
    model = get_model_class(config.architecture)(config, attn_backend=backend)
    model.load_weights(hf_model.state_dict().items())
    seqs = random_seqs({"A": 9, "B": 13, "C": 7, "D": 9})
    ours = run_schedule(model, {k: seqs[k] for k in "ABC"}, MIXED)
    ours |= run_schedule(model, {"D": seqs["D"]}, DECODES, block_size=2)
    for s, ids in seqs.items():
        torch.testing.assert_close(ours[s], hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4,
                                   msg=f"{variant} sequence {s}")


def test_parsed_configs():
    qwen3 = our_config(make_hf_model("qwen3"))
    assert qwen3.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert [qwen3.layer_sliding_window(i) for i in range(3)] == [None, 5, 5]
    assert qwen3.max_context_len == 32  # yarn: original 8 x factor 4
    gemma = our_config(make_hf_model("gemma3"))
    assert (gemma.rope_theta, gemma.rope_local_theta) == (100000.0, 1000.0)
    assert gemma.rope_scaling["rope_type"] == "linear" and gemma.rope_local_scaling is None
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.query_pre_attn_scalar == 24
    phi3 = our_config(make_hf_model("phi3"))
    assert phi3.rotary_dim == 8 and phi3.layer_types is None and phi3.sliding_window == 6
    assert phi3.rope_scaling["original_max_position_embeddings"] == 32
    # legacy hub configs: Gemma 3 pattern + rope_local_base_freq, Qwen2 max_window_layers,
    # Phi-3 "su", use_sliding_window off
    base = dict(architectures=["X"], vocab_size=8, hidden_size=16, intermediate_size=8,
                num_hidden_layers=4, num_attention_heads=2)
    legacy = ModelConfig.from_hf_config(dict(
        base, model_type="gemma3_text", sliding_window=8, sliding_window_pattern=2,
        rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear",
                                                               "factor": 8.0}))
    assert legacy.layer_types == ("sliding_attention", "full_attention") * 2
    assert (legacy.rope_theta, legacy.rope_local_theta, legacy.rope_local_scaling) == \
        (1e6, 1e4, None)
    assert legacy.query_pre_attn_scalar == 256
    qwen2 = ModelConfig.from_hf_config(dict(base, model_type="qwen2", sliding_window=8,
                                            use_sliding_window=True, max_window_layers=3))
    assert qwen2.layer_types == ("full_attention",) * 3 + ("sliding_attention",)
    qwen2_all_full = ModelConfig.from_hf_config(dict(base, model_type="qwen2", sliding_window=8,
                                                     use_sliding_window=True,
                                                     max_window_layers=4))
    assert qwen2_all_full.sliding_window is None and qwen2_all_full.layer_types is None
    assert ModelConfig.from_hf_config(dict(base, model_type="qwen2",
                                           sliding_window=8)).sliding_window is None
    su = ModelConfig.from_hf_config(dict(
        base, model_type="phi3", max_position_embeddings=64, original_max_position_embeddings=16,
        rope_scaling={"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}))
    assert su.rope_scaling["rope_type"] == "longrope"
    assert su.rope_scaling["original_max_position_embeddings"] == 16
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_config(dict(base, model_type="gemma3_text",
                                        use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig(**{**{f: getattr(phi3, f) for f in phi3.__dataclass_fields__},
                       "layer_types": ("full_attention",)})


def test_cpu_decode_fast_path_only_for_plain_llama_layers():
    """The raw-kernel decode path (models/cpu_decode.py) knows Llama's layers only:
    QK-norm and sandwich-norm models run their modules; Phi-3 (Llama layers,
    partial rotary) keeps it and still matches transformers in batched decodes."""
    from tests.test_llama_model import BATCHED

    flags = {}
    for variant in ("qwen3", "gemma3", "phi3"):
        config = our_config(make_hf_model(variant))
        flags[variant] = getattr(get_model_class(config.architecture)(config).model,
                                 "use_cpu_decode_path", False)
    assert flags == {"qwen3": False, "gemma3": False, "phi3": True}
    hf_model = make_hf_model("phi3")
    config = our_config(hf_model)
    model = get_model_class(config.architecture)(config)
    model.load_weights(hf_model.state_dict().items())
    seqs = random_seqs({"A": 6, "B": 4, "E": 11}, seed=4)
    ours = run_schedule(model, seqs, BATCHED)
    for s, ids in seqs.items():
        torch.testing.assert_close(ours[s], hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4)

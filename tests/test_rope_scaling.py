"""RoPE scalings against transformers' own rotary embeddings, beyond the original context.

Static types ("linear", "llama3", "yarn") are compared on every position at once,
"longrope" on tables within and beyond the original context (one factor set each,
as vLLM picks it by max_model_len), "dynamic" position by position as transformers
computes it while generating token by token (``seq_len = position + 1``).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from llmserve.config import ModelConfig
from llmserve.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb, rope_cos_sin

HEAD_DIM = 16
MAX_POS = 16  # the "original" context of every case; tables extend to 4x beyond
LLAMA = dict(vocab_size=32, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_POS)

STATIC = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": MAX_POS},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAX_POS},
    "yarn_mscale_betas": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                          "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                          "truncate": False, "original_max_position_embeddings": MAX_POS},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": MAX_POS},
}


def _hf_cos_sin(rotary, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin of ``positions`` (one forward), first half of each row."""
    x = torch.zeros(1, len(positions), HEAD_DIM)
    cos, sin = rotary(x, torch.tensor([positions]))
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


@pytest.mark.parametrize("case", list(STATIC))
def test_static_scalings_match_transformers(case):
    rope = {**STATIC[case], "rope_theta": 10000.0}
    hf = LlamaRotaryEmbedding(transformers.LlamaConfig(**LLAMA, rope_parameters=dict(rope)))
    max_len = 4 * MAX_POS
    cos, sin = rope_cos_sin(HEAD_DIM, max_len, 10000.0, rope, MAX_POS)
    ref_cos, ref_sin = _hf_cos_sin(hf, list(range(max_len)))
    torch.testing.assert_close(cos, ref_cos, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sin, ref_sin, atol=1e-5, rtol=1e-5)


def test_dynamic_ntk_matches_transformers_token_by_token():
    rope = {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0}
    hf = LlamaRotaryEmbedding(transformers.LlamaConfig(**LLAMA, rope_parameters=dict(rope)))
    max_len = 4 * MAX_POS
    cos, sin = rope_cos_sin(HEAD_DIM, max_len, 10000.0, rope, MAX_POS)
    base_cos, _ = rope_cos_sin(HEAD_DIM, max_len, 10000.0, None)
    for p in range(max_len):  # increasing, as generation goes: HF regrows each step
        ref_cos, ref_sin = _hf_cos_sin(hf, [p])
        torch.testing.assert_close(cos[p:p + 1], ref_cos, atol=1e-5, rtol=1e-5, msg=f"pos {p}")
        torch.testing.assert_close(sin[p:p + 1], ref_sin, atol=1e-5, rtol=1e-5, msg=f"pos {p}")
    assert torch.equal(cos[:MAX_POS], base_cos[:MAX_POS])  # unscaled within the context
    assert not torch.allclose(cos[MAX_POS + 8:], base_cos[MAX_POS + 8:], atol=1e-3)


def test_longrope_partial_rotary_matches_transformers():
    """Phi-3 longrope with half of each head rotating: a table within the original context
    holds the short factors, a longer one the long factors; each equals transformers on
    a forward pass that long."""
    orig, rotary_dim = 16, HEAD_DIM // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [1.1, 2.5, 5.0, 8.0]}
    config = transformers.Phi3Config(**{**LLAMA, "max_position_embeddings": 4 * orig},
                                     original_max_position_embeddings=orig,
                                     partial_rotary_factor=0.5, rope_parameters=dict(rope),
                                     pad_token_id=None, eos_token_id=None, bos_token_id=None)
    ours = ModelConfig.from_hf_config(config.to_dict())
    assert ours.rotary_dim == rotary_dim and ours.max_context_len == 4 * orig
    for max_len in (orig, 4 * orig):
        emb = RotaryEmbedding(ours.rotary_dim, max_len, ours.rope_theta, ours.rope_scaling,
                              max_position_embeddings=ours.max_position_embeddings)
        ref_cos, ref_sin = _hf_cos_sin(Phi3RotaryEmbedding(config), list(range(max_len)))
        torch.testing.assert_close(emb.cos_cache, ref_cos, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(emb.sin_cache, ref_sin, atol=1e-5, rtol=1e-5)
    short = RotaryEmbedding(rotary_dim, orig, 10000.0, ours.rope_scaling,
                            max_position_embeddings=4 * orig)
    assert not torch.allclose(short.cos_cache[1:], emb.cos_cache[1:orig], atol=1e-3)
    # the attention factor sqrt(1 + ln(4) / ln(16)) scales cos/sin everywhere
    assert emb.cos_cache[0, 0].item() == pytest.approx((1 + 2 / 4) ** 0.5, rel=1e-6)
    # partial rotary: the pass-through half of each head is untouched
    q, k = torch.randn(5, 3, HEAD_DIM), torch.randn(5, 2, HEAD_DIM)
    positions = torch.tensor([0, 3, 17, 40, 63])
    q_rot, k_rot = emb(positions, q, k)
    assert torch.equal(q_rot[..., rotary_dim:], q[..., rotary_dim:])
    cos, sin = emb.get_cos_sin(positions)
    torch.testing.assert_close(k_rot[..., :rotary_dim], apply_rotary_emb(k[..., :rotary_dim],
                                                                         cos, sin))


def test_context_length_and_errors():
    fields = dict(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=16,
                  intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                  num_key_value_heads=1, max_position_embeddings=100)
    ctx = {name: ModelConfig(**fields, rope_scaling=rs).max_context_len for name, rs in {
        "none": None, "linear": {"rope_type": "linear", "factor": 2.0},
        "dynamic": {"type": "dynamic", "factor": 3.0},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 50},
        "llama3": STATIC["llama3"]}.items()}
    assert ctx == {"none": 100, "linear": 200, "dynamic": 300, "yarn": 200, "llama3": 100}
    with pytest.raises(ValueError, match="'su2'.*yarn"):
        rope_cos_sin(8, 4, 10000.0, {"rope_type": "su2"})
    with pytest.raises(ValueError, match="'yarn' needs the field 'original_max_position"):
        rope_cos_sin(8, 4, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="short_factor has 3 values"):
        rope_cos_sin(8, 4, 10000.0, {"rope_type": "longrope", "short_factor": [1.0] * 3,
                                     "long_factor": [1.0] * 4,
                                     "original_max_position_embeddings": 2})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig(**fields, partial_rotary_factor=0.2)

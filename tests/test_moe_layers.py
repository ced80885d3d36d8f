"""Mixture-of-experts layers: the top-k router and the expert-grouped fused expert loop,
against a dense reference that runs every expert on every token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.layers.moe import FusedMoE, SparseMoeBlock, fused_experts, moe_align, select_experts

E, H, I = 8, 32, 24  # noqa: E741 (intermediate size)


def silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def dense_reference(hidden, w13, w2, topk_weights, topk_ids):
    """Every expert on every token, combined by a [T, E] weight matrix (0 where unselected)."""
    combine = torch.zeros(hidden.shape[0], w13.shape[0], dtype=torch.float64)
    combine.scatter_(1, topk_ids, topk_weights.double())
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for e in range(w13.shape[0]):
        y = F.linear(silu_and_mul(F.linear(hidden.double(), w13[e].double())), w2[e].double())
        out += combine[:, e:e + 1] * y
    return out


def random_experts(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.2).to(dtype)
    return g, w13, w2


def test_select_experts_matches_softmax_topk():
    logits = torch.randn(10, E, generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(logits.double(), -1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    ref_w, ref_ids = probs.topk(2, -1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.double(), ref_w)
    weights, _ = select_experts(logits, 3, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))
    torch.testing.assert_close(weights.double(), (w := probs.topk(3, -1).values) / w.sum(-1, True))
    bf16 = logits.bfloat16()
    assert select_experts(bf16, 2, True).__getitem__(0).dtype == torch.bfloat16
    assert select_experts(bf16, 2, True, torch.float32)[0].dtype == torch.float32
    with pytest.raises(ValueError, match="top_k must be in 1..8"):
        select_experts(logits, 9, True)


def test_moe_align_groups_slots_by_expert():
    ids = torch.tensor([[3, 0], [0, 5], [3, 1]])
    slots, counts = moe_align(ids, 6)
    assert counts == [2, 1, 0, 2, 0, 1]
    assert ids.reshape(-1)[slots].tolist() == [0, 0, 1, 3, 3, 5]
    assert (slots // 2).tolist() == [0, 1, 2, 0, 2, 1]  # tokens ascending within an expert


@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (13, 2), (40, 3)])
def test_fused_experts_equals_dense_and_runs_only_routed_tokens(num_tokens, top_k):
    g, w13, w2 = random_experts()
    hidden = torch.randn(num_tokens, H, generator=g)
    logits = torch.randn(num_tokens, E, generator=g)
    logits[:, 6] = -1e4  # expert 6 is never chosen
    weights, ids = select_experts(logits, top_k, renormalize=True)
    calls = []  # (expert, rows) of every expert matmul

    def recording_linear(x, w, b=None):
        for e in range(E):
            if w.data_ptr() == w13[e].data_ptr():
                calls.append((e, x.clone()))
        return F.linear(x, w, b)
    out = fused_experts(hidden, w13, w2, weights, ids, silu_and_mul, linear=recording_linear)
    torch.testing.assert_close(out.double(), dense_reference(hidden, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)
    # each selected expert ran once, on exactly its routed tokens; the others never ran
    routed = {e: sorted(t for t in range(num_tokens) if e in ids[t].tolist()) for e in range(E)}
    assert sorted(e for e, _ in calls) == [e for e in range(E) if routed[e]]
    assert 6 not in [e for e, _ in calls]
    assert sum(x.shape[0] for _, x in calls) == num_tokens * top_k
    for e, x in calls:
        assert torch.equal(x, hidden[routed[e]]), e


def test_fused_experts_bfloat16_close_and_empty_batch():
    g, w13, w2 = random_experts(2)
    hidden = torch.randn(9, H, generator=g)
    weights, ids = select_experts(torch.randn(9, E, generator=g), 2, renormalize=False)
    ref = dense_reference(hidden, w13, w2, weights, ids)
    out = fused_experts(hidden.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights.bfloat16(),
                        ids, silu_and_mul)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 0.03 * ref.abs().max()
    empty = fused_experts(hidden[:0], w13, w2, weights[:0], ids[:0], silu_and_mul)
    assert empty.shape == (0, H)


def test_fused_moe_weight_loader_and_errors():
    moe = FusedMoE(E, H, I)
    _, w13, w2 = random_experts(3)
    for e in range(E):
        moe.weight_loader(moe.w13_weight, w13[e, :I], (e, "w1"))
        moe.weight_loader(moe.w13_weight, w13[e, I:], (e, "w3"))
        moe.weight_loader(moe.w2_weight, w2[e], (e, "w2"))
    assert torch.equal(moe.w13_weight, w13) and torch.equal(moe.w2_weight, w2)
    with pytest.raises(ValueError, match=r"expert 0 w1: expected shape \(24, 32\)"):
        moe.weight_loader(moe.w13_weight, w13[0], (0, "w1"))
    with pytest.raises(ValueError, match="expert 8 out of range"):
        moe.weight_loader(moe.w2_weight, w2[0], (8, "w2"))
    with pytest.raises(ValueError, match="does not belong"):
        moe.weight_loader(moe.w13_weight, w2[0], (0, "w2"))
    with pytest.raises(ValueError, match="unknown expert shard 'w4'"):
        moe.weight_loader(moe.w2_weight, w2[0], (0, "w4"))
    with pytest.raises(ValueError, match="num_experts_per_tok must be in 1..8"):
        SparseMoeBlock(H, E, 9, I, "silu", True)


def test_moe_config_fields_and_errors():
    from llmserve.config import ModelConfig
    from llmserve.models import get_model_class

    base = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1)
    mixtral = ModelConfig.from_hf_config(dict(base, architectures=["MixtralForCausalLM"],
                                              model_type="mixtral", num_local_experts=4,
                                              num_experts_per_tok=2))
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == \
        (4, 24, True)
    qwen = ModelConfig.from_hf_config(dict(
        base, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8, decoder_sparse_step=2,
        mlp_only_layers=[3]))
    assert qwen.attention_bias and not qwen.norm_topk_prob  # qkv_bias defaults to true
    assert [qwen.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in 1\.\.num_experts \(4\)"):
        ModelConfig.from_hf_config(dict(base, model_type="mixtral", num_local_experts=4,
                                        num_experts_per_tok=5))
    dense = ModelConfig(architecture="MixtralForCausalLM", **base)
    with pytest.raises(ValueError, match="needs num_experts > 0"):
        get_model_class("MixtralForCausalLM")(dense)
    # Qwen2-MoE without layer_types: the window covers the even layers below max_window_layers
    sliding = ModelConfig.from_hf_config(dict(
        base, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=4,
        num_experts_per_tok=2, use_sliding_window=True, sliding_window=8, max_window_layers=3))
    assert sliding.sliding_window == 8
    assert sliding.layer_types == ("sliding_attention", "full_attention", "sliding_attention",
                                   "full_attention")

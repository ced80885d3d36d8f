"""LlamaForCausalLM against Hugging Face transformers on small random models.

Each test loads ``hf_model.state_dict()`` through ``load_weights`` and runs a
paged, chunked, mixed schedule (decodes, prefill chunks with earlier context
and fresh prefills in one step, shuffled non-contiguous blocks); every
position's logits must match the HF model run on each full sequence.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from llmserve.config import ModelConfig
from llmserve.layers.attention import CommonAttentionMetadata
from llmserve.models import LlamaForCausalLM, get_model_class

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5)

VARIANTS = {
    "llama": ("LlamaForCausalLM", transformers.LlamaConfig, {}),
    "llama3_rope_tied": ("LlamaForCausalLM", transformers.LlamaConfig, dict(
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16})),
    "llama_linear_rope_bias": ("LlamaForCausalLM", transformers.LlamaConfig, dict(
        attention_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                              "factor": 2.0})),
    "mistral_sliding_window": ("MistralForCausalLM", transformers.MistralConfig,
                               dict(sliding_window=5)),
    "qwen2_bias_tied": ("Qwen2ForCausalLM", transformers.Qwen2Config,
                        dict(tie_word_embeddings=True)),
}


def to_model_config(arch: str, hf_config) -> ModelConfig:
    rope = dict(hf_config.rope_parameters)
    rope_type = rope.get("rope_type", "default")
    return ModelConfig(
        architecture=arch, model_type=hf_config.model_type, vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size, intermediate_size=hf_config.intermediate_size,
        num_hidden_layers=hf_config.num_hidden_layers,
        num_attention_heads=hf_config.num_attention_heads,
        num_key_value_heads=hf_config.num_key_value_heads, rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=rope["rope_theta"], rope_scaling=None if rope_type == "default" else rope,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=hf_config.tie_word_embeddings,
        attention_bias=getattr(hf_config, "attention_bias", False)
        or hf_config.model_type == "qwen2",
        sliding_window=getattr(hf_config, "sliding_window", None))


def make_hf_model(variant: str, dtype=torch.float32):
    arch, config_cls, extra = VARIANTS[variant]
    hf_config = config_cls(**SMALL, **extra)
    torch.manual_seed(0)
    hf_model = getattr(transformers, arch)(hf_config).eval()
    with torch.no_grad():  # random norms and biases too, so every weight matters
        for name, p in hf_model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return hf_model.to(dtype), to_model_config(arch, hf_config)


def make_model(config: ModelConfig, hf_model, backend: str, dtype=torch.float32):
    model = get_model_class(config.architecture)(config, dtype=dtype, attn_backend=backend)
    model.load_weights(hf_model.state_dict().items())
    return model


def run_schedule(model, seqs: dict[str, list[int]], schedule, block_size=4, seed=0):
    """Run ``schedule`` (steps of ``(seq, num_tokens)``, decodes first) on paged
    caches with shuffled blocks; returns each sequence's logits ``[len, vocab]``."""
    rng = random.Random(seed)
    needed = {s: -(-len(ids) // block_size) for s, ids in seqs.items()}
    pool = list(range(sum(needed.values()) + 4))
    rng.shuffle(pool)
    block_tables = {}
    for s, n in needed.items():
        block_tables[s], pool = pool[:n], pool[n:]
    shape = model.get_kv_cache_shape(sum(needed.values()) + 4, block_size)
    kv_caches = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
                 for _ in range(model.num_layers)]
    computed = dict.fromkeys(seqs, 0)
    logits = {s: [None] * len(ids) for s, ids in seqs.items()}
    for step in schedule:
        ids, positions, query_lens, seq_lens = [], [], [], []
        for s, n in step:
            start = computed[s]
            ids += seqs[s][start:start + n]
            positions += range(start, start + n)
            query_lens.append(n)
            seq_lens.append(start + n)
        common = CommonAttentionMetadata.from_lists(
            query_lens, seq_lens, [block_tables[s] for s, _ in step], block_size,
            sliding_window=model.sliding_window)
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(positions), kv_caches,
                           model.attn_backend_cls.build_metadata(common))
            step_logits = model.compute_logits(hidden)
        assert step_logits.dtype == torch.float32
        row = 0
        for s, n in step:
            for p in range(computed[s], computed[s] + n):
                logits[s][p] = step_logits[row]
                row += 1
            computed[s] += n
    return {s: torch.stack(rows) for s, rows in logits.items()}


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def random_seqs(lengths: dict[str, int], vocab: int = 128, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return {s: torch.randint(0, vocab, (n,), generator=gen).tolist() for s, n in lengths.items()}


# step 1: A prefills 8 tokens, B its first chunk (positions 0..4)
# step 2: A decodes its 9th token, B chunk 5..12 with 0..4 cached, C a fresh 7-token prefill
MIXED = [[("A", 8), ("B", 5)], [("A", 1), ("B", 8), ("C", 7)]]
# single fresh prefill (is_causal fast path), then decodes alone
DECODES = [[("D", 6)], [("D", 1)], [("D", 1)], [("D", 1)]]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers_fp32(variant, backend):
    hf_model, config = make_hf_model(variant)
    model = make_model(config, hf_model, backend)
    seqs = random_seqs({"A": 9, "B": 13, "C": 7, "D": 9})
    ours = run_schedule(model, {k: seqs[k] for k in "ABC"}, MIXED)
    ours |= run_schedule(model, {"D": seqs["D"]}, DECODES, block_size=2)
    for s, ids in seqs.items():
        torch.testing.assert_close(ours[s], hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4,
                                   msg=f"sequence {s}")


def test_bfloat16_close_to_transformers():
    hf_model, config = make_hf_model("llama", dtype=torch.bfloat16)
    model = make_model(config, hf_model, "cpu", dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    seqs = random_seqs({"A": 9, "B": 13, "C": 7})
    ours = run_schedule(model, seqs, MIXED)
    for s, ids in seqs.items():
        ref = hf_logits(hf_model, ids)
        assert (ours[s] - ref).abs().max() < 0.05 * ref.abs().max(), s


# three sequences prefill, then decode together (batched pure decode steps); E is
# longer than mistral's window of 5
BATCHED = [[("A", 4), ("B", 2), ("E", 9)], [("A", 1), ("B", 1), ("E", 1)],
           [("A", 1), ("B", 1), ("E", 1)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["llama", "mistral_sliding_window", "qwen2_bias_tied"])
def test_cpu_decode_fast_path_matches_module_path(variant, dtype, monkeypatch):
    """Pure decode steps run models/cpu_decode.py (raw kernel calls); the same steps
    through the modules must give the same logits, bit for bit (same kernels, same
    order), and match transformers."""
    from llmserve.models import cpu_decode

    hf_model, config = make_hf_model(variant, dtype=dtype)
    model = make_model(config, hf_model, "cpu", dtype=dtype)
    seqs = random_seqs({"A": 6, "B": 4, "E": 11}, seed=4)
    used = []
    build = cpu_decode.CpuDecodeStep.build
    monkeypatch.setattr(cpu_decode.CpuDecodeStep, "build",
                        classmethod(lambda cls, *a: used.append(build(*a)) or used[-1]))
    fast = run_schedule(model, seqs, BATCHED)
    assert [u is not None for u in used] == [False, True, True]  # the decode steps only
    monkeypatch.setattr(cpu_decode.CpuDecodeStep, "build", classmethod(lambda cls, *a: None))
    slow = run_schedule(model, seqs, BATCHED)
    for s, ids in seqs.items():
        assert torch.equal(fast[s], slow[s]), s
        if dtype == torch.float32:
            torch.testing.assert_close(fast[s], hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4)


def test_load_weights_errors():
    hf_model, config = make_hf_model("llama")
    state = dict(hf_model.state_dict())
    model = LlamaForCausalLM(config)
    bad = dict(state, **{"model.layers.0.self_attn.qq_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.self_attn\.qq_proj"):
        model.load_weights(bad.items())
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing weights.*model\.layers\.1\.mlp\.up_proj\.weight"):
        model.load_weights(missing.items())
    wrong = dict(state, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        model.load_weights(wrong.items())
    # ignored names load fine
    model.load_weights(dict(state, **{"model.rotary_emb.inv_freq": torch.ones(8)}).items())


def test_config_errors():
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")
    _, config = make_hf_model("llama")
    fields = {f: getattr(config, f) for f in config.__dataclass_fields__}
    yarn = ModelConfig(**dict(fields, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="'yarn'"):
        LlamaForCausalLM(yarn)
    with pytest.raises(ValueError, match="'relu'"):
        LlamaForCausalLM(ModelConfig(**dict(fields, hidden_act="relu")))
    with pytest.raises(ValueError, match="'ntk-by-magic'.*longrope"):
        LlamaForCausalLM(ModelConfig(**dict(fields, rope_scaling={"rope_type": "ntk-by-magic"})))
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        LlamaForCausalLM(config, attn_backend="flash")
    model = LlamaForCausalLM(config)
    assert model.get_kv_cache_shape(10, 16) == (10, 16, 2, 16)

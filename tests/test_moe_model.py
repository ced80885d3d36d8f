"""Mixtral, Qwen2-MoE and Qwen3-MoE against Hugging Face transformers, float32.

Each architecture is a small random-weight model built by transformers and saved with
``save_pretrained`` (per-expert checkpoint names, as on the Hub); our loader reads that
directory. The model must match transformers' logits on a paged, chunked, mixed schedule,
and the engine (``LLM``) must give transformers' greedy tokens, alone and batched under
chunked prefill with a small ``max_num_batched_tokens``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from llmserve.loader.safetensors_loader import iter_safetensors_weights, read_hf_config
from llmserve.models import get_model_class
from llmserve.planner.ledger import count_parameters
from tests.conftest import engine_variant
from tests.test_llama_model import DECODES, MIXED, hf_logits, random_seqs, run_schedule

VOCAB = 128
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, eos_token_id=VOCAB - 1, bos_token_id=None)
VARIANTS = {
    # 8 experts, top-2, renormalized; sliding window over every layer, as in Mistral
    "mixtral": ("Mixtral", dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=6)),
    # shared expert with a sigmoid gate; layer 1 dense (mlp_only_layers); q/k/v bias;
    # a window of 6 on layer 0 only (Qwen2MoeConfig: even layers below max_window_layers)
    "qwen2_moe": ("Qwen2Moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                   use_sliding_window=True, sliding_window=6,
                                   max_window_layers=2)),
    # QK-norm, head_dim != hidden / heads, top-3 of 6, norm_topk_prob
    "qwen3_moe": ("Qwen3Moe", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                   head_dim=32, norm_topk_prob=True)),
}


def save_word_tokenizer(path: str) -> None:
    """A word-level tokenizer over ids 0..VOCAB-1 ("t0".."t126", eos "</s>" = VOCAB - 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"</s>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(path)


@pytest.fixture(scope="module", params=list(VARIANTS))
def moe(request, tmp_path_factory):
    """(variant, model dir, transformers model) for one architecture."""
    cls, extra = VARIANTS[request.param]
    hf_config = getattr(transformers, f"{cls}Config")(**SMALL, **extra)
    torch.manual_seed(0)
    hf_model = getattr(transformers, f"{cls}ForCausalLM")(hf_config).eval()
    with torch.no_grad():  # random norms too, and weights large enough for clear routing
        for name, p in hf_model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(str(path))
    save_word_tokenizer(str(path))
    return request.param, str(path), hf_model


def load_ours(path: str, backend: str = "cpu"):
    config = read_hf_config(path)
    model = get_model_class(config.architecture)(config, torch.float32, backend)
    model.load_weights(iter_safetensors_weights(path))
    return model


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_logits_match_transformers_paged_mixed_schedule(moe, backend):
    variant, path, hf_model = moe
    model = load_ours(path, backend)
    assert model.model.use_cpu_decode_path is False  # the Llama-only decode fast path is skipped
    seqs = random_seqs({"A": 9, "B": 13, "C": 7, "D": 9}, vocab=VOCAB)
    ours = run_schedule(model, {k: seqs[k] for k in "ABC"}, MIXED)
    ours |= run_schedule(model, {"D": seqs["D"]}, DECODES, block_size=2)
    for s, ids in seqs.items():
        torch.testing.assert_close(ours[s], hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4,
                                   msg=f"{variant} sequence {s}")


def test_bfloat16_close_to_transformers(moe):
    variant, path, hf_model = moe
    config = read_hf_config(path)
    model = get_model_class(config.architecture)(config, torch.bfloat16)
    model.load_weights(iter_safetensors_weights(path))
    assert model.model.layers[0].mlp.experts.w13_weight.dtype == torch.bfloat16
    hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    seqs = random_seqs({"A": 9, "B": 13, "C": 7}, vocab=VOCAB)
    ours = run_schedule(model, seqs, MIXED)
    for s, ids in seqs.items():
        ref = hf_logits(hf_bf16, ids)
        assert (ours[s] - ref).abs().max() < 0.1 * ref.abs().max(), (variant, s)


def test_config_and_layers(moe):
    variant, path, hf_model = moe
    config = read_hf_config(path)
    model = load_ours(path)
    layers = model.model.layers
    if variant == "mixtral":
        assert config.norm_topk_prob and config.num_experts == 8 and config.sliding_window == 6
        assert all(type(layer.mlp).__name__ == "SparseMoeBlock" for layer in layers)
        # the memory planner counts the experts (exact for Mixtral: no shared expert gate)
        counts = count_parameters(config)
        assert counts.total == sum(p.numel() for p in hf_model.parameters())
        assert counts.active < counts.total - counts["embeddings"]
    elif variant == "qwen2_moe":
        assert config.attention_bias and config.shared_expert_intermediate_size == 48
        assert config.layer_types == ("sliding_attention", "full_attention")
        assert [type(layer.mlp).__name__ for layer in layers] == ["SparseMoeBlock", "LlamaMLP"]
        assert layers[0].mlp.shared_expert_gate.weight.shape == (1, 64)
    else:
        assert config.norm_topk_prob and config.head_dim == 32 and not config.attention_bias
        assert layers[0].self_attn.q_norm.weight.shape == (32,)
    # every parameter of the HF model was loaded: same total size
    assert sum(p.numel() for p in model.parameters()) == \
        sum(p.numel() for p in hf_model.parameters())


def hf_greedy(hf_model, ids: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        # an explicit mask: generate() would otherwise treat token pad_token_id as padding
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


NEW_TOKENS = 8


def test_engine_greedy_alone_and_batched_chunked_prefill(moe):
    from llmserve import LLM, SamplingParams

    variant, path, hf_model = moe
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in (1, 5, 19, 30)]
    ref = [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]
    llm = LLM(model=path, dtype="float32", kv_cache_memory="4MiB", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def run(engine):
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    alone = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
             for p in prompts]
    assert alone == ref, f"{variant}: alone"
    # 8 tokens a step: the 19- and 30-token prompts prefill in chunks next to decodes
    chunked = engine_variant(llm, scheduler={"max_num_batched_tokens": 8, "max_num_seqs": 4})
    assert run(chunked) == ref, f"{variant}: batched, chunked prefill"
    assert chunked.engine.scheduler.kv_cache_manager.get_num_free_blocks() == \
        chunked.engine.scheduler.kv_cache_manager.num_usable_blocks


def test_load_errors_name_the_expert_weight(moe):
    variant, path, _ = moe
    block = "block_sparse_moe" if variant == "mixtral" else "mlp"
    down = "w2" if variant == "mixtral" else "down_proj"
    name = f"model.layers.0.{block}.experts.3.{down}.weight"
    state = dict(iter_safetensors_weights(path))
    config = read_hf_config(path)
    model = get_model_class(config.architecture)(config)
    with pytest.raises(ValueError, match=rf"missing weights.*{name.replace('.', '[.]')}"):
        model.load_weights((k, v) for k, v in state.items() if k != name)
    with pytest.raises(ValueError, match=rf"weight '{name}': expert 3 w2: expected shape"):
        model.load_weights(dict(state, **{name: state[name].T}).items())
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.mlp.experts.w2_weight'"):
        model.load_weights(dict(state, **{"model.layers.0.mlp.experts.w2_weight": state[name]}).items())

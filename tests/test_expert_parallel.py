"""Expert parallelism with real processes (torch.distributed, gloo, loopback), float32.

A small random-weight MoE model from transformers (tests/test_moe_model.py builds the
same ones) runs at ``tensor_parallel_size=2, enable_expert_parallel=True``: attention
split as tensor parallelism does, each rank holding half the experts, the routed sum
combined by an all-reduce. With top-2 routing the combine is bit-identical to the
single-process expert sum (llmserve.models.expert_parallel), so the greedy tokens must
equal both the single-process engine's and transformers' (the oracle).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from llmserve import LLM, SamplingParams
from llmserve.config import ParallelConfig
from llmserve.loader.safetensors_loader import read_hf_config
from tests.test_moe_model import SMALL, VARIANTS, VOCAB, hf_greedy, save_word_tokenizer

pytestmark = pytest.mark.model
NEW_TOKENS = 8


def _build(variant: str, path: str):
    cls, extra = VARIANTS[variant]
    torch.manual_seed(0)
    hf_model = getattr(transformers, f"{cls}ForCausalLM")(
        getattr(transformers, f"{cls}Config")(**SMALL, **extra)).eval()
    with torch.no_grad():  # as test_moe_model: clear routing
        for name, p in hf_model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    hf_model.save_pretrained(path)
    save_word_tokenizer(path)
    return hf_model


# Qwen2-MoE: shared expert with its gate (replicated), a dense layer (tensor-parallel),
# 8 experts top-2; Mixtral: every layer sparse, float32 router weights
@pytest.mark.parametrize("variant", ["qwen2_moe", "mixtral"])
def test_ep2_greedy_equals_single_process_and_transformers(variant, tmp_path):
    hf_model = _build(variant, str(tmp_path))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in (3, 11, 26)]
    ref = [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    kw = dict(model=str(tmp_path), dtype="float32", kv_cache_memory="4MiB", block_size=4,
              max_num_batched_tokens=16)  # the 26-token prompt prefills in chunks
    single = [o.outputs[0].token_ids for o in LLM(**kw).generate(inputs, params, use_tqdm=False)]
    ep = LLM(**kw, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        experts = [m for m in ep.engine.runner.model.modules()
                   if type(m).__name__ == "ExpertParallelFusedMoE"]
        assert experts and all(m.num_local_experts == 4 and m.expert_start == 0
                               for m in experts)  # rank 0 holds experts 0..3 of 8
        got = [o.outputs[0].token_ids for o in ep.generate(inputs, params, use_tqdm=False)]
    finally:
        ep.engine.shutdown()
    assert single == ref, f"{variant}: single process vs transformers"
    assert got == ref, f"{variant}: ep=2 vs transformers"


def test_moe_tp_without_expert_parallel_or_indivisible_is_a_clear_error(tmp_path):
    _build("qwen3_moe", str(tmp_path))  # 6 experts
    config = read_hf_config(str(tmp_path))
    with pytest.raises(ValueError, match="needs --enable-expert-parallel"):
        ParallelConfig(tensor_parallel_size=2).check_model(config)
    ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).check_model(config)
    with pytest.raises(ValueError, match=r"must divide num_experts 6; sizes that work: 1, 2"):
        ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True).check_model(config)

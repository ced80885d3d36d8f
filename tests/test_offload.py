"""CPU offload (``--cpu-offload-gb``) and the layer split (``--num-device-layers`` /
``--n-gpu-layers``): the same outputs as the model run whole on one device.

The oracle is the engine without either option on the same weights: greedy tokens and
logprobs must be identical (the weights a layer computes with are copies of the same
bytes, and the layer split moves activations without changing them). On a CPU-only
machine the "device" is the CPU: the hooks, the host buffers, the staging slots, the
copies and the metadata rebuild at the split all run; a skipped copy changes outputs
(checked below). ``test_cuda_offload_and_split`` runs the real GPU path where CUDA is.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from llmserve.config import ModelConfig, OffloadConfig
from llmserve.models import LlamaForCausalLM
from llmserve.worker.layer_split import install_offload
from llmserve.worker.offload import WeightOffloader, layer_tensors
from tests.test_llama_model import random_seqs, run_schedule

TINY = ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=128,
                   hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   rms_norm_eps=1e-5)
DECODES = [[("A", 8), ("B", 5)], [("A", 1), ("B", 8), ("C", 7)], [("A", 1), ("B", 1), ("C", 1)],
           [("A", 1), ("B", 1), ("C", 1)]]
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a land far away, there lived a", "1, 2, 3, 4,"]


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model.eval()


def placed(model, device="cpu", **offload):
    model = copy.deepcopy(model)
    install_offload(model, SimpleNamespace(offload_config=OffloadConfig(**offload),
                                           device=device))
    return model


def layer_bytes(layer) -> int:
    return sum(t.numel() * t.element_size() for t in layer_tensors(layer))


def test_tiny_offload_and_split_equal_whole_model(monkeypatch):
    base = tiny_model()
    seqs = random_seqs({"A": 11, "B": 15, "C": 9})
    ref = run_schedule(base, seqs, DECODES)
    per_layer = layer_bytes(base.model.layers[0])
    # three layers offloaded: two staging slots, layers 0 and 2 share one
    off = placed(base, cpu_offload_gb=3.5 * per_layer / 1024**3)
    hooks = off.model.layer_hooks
    stats = off.offload_stats
    assert stats.layers == [0, 1, 2] and stats.host_bytes >= 3 * per_layer
    assert stats.staging_bytes == 2 * stats.host_bytes // 3
    w0, w2 = (off.model.layers[i].mlp.down_proj.weight for i in (0, 2))
    assert w0.untyped_storage().data_ptr() == w2.untyped_storage().data_ptr()
    split = placed(base, num_device_layers=2)
    both = placed(base, num_device_layers=4, cpu_offload_gb=1.5 * per_layer / 1024**3)
    assert both.offload_stats.layers == [0]
    for model in (off, split, both):
        out = run_schedule(model, seqs, DECODES)
        for s in seqs:
            torch.testing.assert_close(out[s], ref[s], rtol=0, atol=0)
    # the copy is real: without it, layer 2 computes with layer 0's weights
    monkeypatch.setattr(WeightOffloader, "load", lambda self, i: None)
    assert hooks.offloader is not None
    broken = run_schedule(off, seqs, DECODES)
    assert not any(torch.equal(broken[s], ref[s]) for s in seqs)


def test_bad_values():
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        OffloadConfig(cpu_offload_gb=-1)
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        OffloadConfig(cpu_offload_gb="lots")
    with pytest.raises(ValueError, match="num_device_layers"):
        OffloadConfig(num_device_layers=-1)
    with pytest.raises(ValueError, match="num_device_layers.*6.*5 decoder layers"):
        OffloadConfig(num_device_layers=6).check_model(TINY)
    with pytest.raises(ValueError, match="more than the model's weights"):
        placed(tiny_model(), cpu_offload_gb=1.0)


def test_bad_values_engine_args():
    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.loader import load_model_config, resolve_model

    mc = load_model_config(resolve_model(None))  # the default model: 30 layers
    with pytest.raises(ValueError, match="num_device_layers.*31.*30 decoder layers"):
        EngineArgs(num_device_layers=31, device="cpu").create_engine_config(mc, "m")
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        EngineArgs(cpu_offload_gb=-2, device="cpu").create_engine_config(mc, "m")
    with pytest.raises(ValueError, match="n-gpu-layers"):
        EngineArgs(num_device_layers=3, device="cpu",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2}
                   ).create_engine_config(mc, "m")


def _outputs(llm, prompts=PROMPTS, max_tokens=6):
    from llmserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.model
def test_engine_fp32_offload_and_split_equal(llm_fp32):
    """The default model in float32, batched: offload and split change no token or logprob."""
    from llmserve import LLM

    ref = _outputs(llm_fp32)
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", num_device_layers=21,
              cpu_offload_gb=0.03)
    stats = llm.engine.runner.model.offload_stats
    assert stats.layers == [0, 1] and stats.host_bytes > 0
    devices = llm.engine.runner.model.layer_devices
    assert len(devices) == 30 and all(kc.device == d for (kc, _), d in
                                      zip(llm.engine.runner.kv_caches, devices))
    assert _outputs(llm) == ref


@pytest.mark.model
def test_engine_default_format_offload_equal():
    """The default format (gguf-hybrid bf16 where the CPU has it): offloaded layers carry
    their packed and dense weights through the slots."""
    from llmserve import LLM

    ref = _outputs(LLM(kv_cache_memory="64MiB"))
    llm = LLM(kv_cache_memory="64MiB", cpu_offload_gb=0.02, num_device_layers=12)
    assert llm.engine.runner.model.offload_stats.num_layers >= 1
    assert _outputs(llm) == ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_and_split():
    """The real GPU path: pinned host copies streamed on a side stream; a split with the
    first layers (and their KV) on CUDA, the rest on the CPU. Same greedy tokens as the
    whole model on CUDA, logprobs within bf16/fp32 kernel noise of the CPU layers."""
    from llmserve import LLM

    kw = dict(device="cuda", dtype="float32", kv_cache_memory="256MiB")
    ref = _outputs(LLM(**kw), max_tokens=12)
    off = LLM(cpu_offload_gb=0.1, **kw)
    model = off.engine.runner.model
    assert model.offload_stats.num_layers >= 2
    w = model.model.layers[0].mlp.down_proj.weight
    assert w.is_cuda
    assert _outputs(off, max_tokens=12) == ref  # same bytes, same CUDA kernels
    split = LLM(num_device_layers=20, **kw)
    kv = split.engine.runner.kv_caches
    assert kv[0][0].is_cuda and not kv[25][0].is_cuda
    out = _outputs(split, max_tokens=12)
    assert [t for t, _ in out] == [t for t, _ in ref]
    for (_, lp), (_, lp_ref) in zip(out, ref):
        for d, d_ref in zip(lp, lp_ref):
            for k in d_ref:
                if k in d:
                    assert abs(d[k] - d_ref[k]) < 1e-2


def test_planner_accounts_for_offload_and_split():
    """``llmserve plan``: device weights + host weights = the model (staging counted on the
    device), KV per token on the device scales with its layers, offload streams its bytes."""
    from llmserve.planner.capacity import plan_capacity
    from llmserve.planner.sources import resolve_model

    m = resolve_model("smollm2-135m-instruct").model
    kw = dict(gpu_memory="4GiB", weight_format="bf16", activation_reserve=0, max_model_len=2048)
    whole = plan_capacity(m, **kw)
    same = plan_capacity(m, num_device_layers=30, **kw)
    assert (same.weight_bytes, same.kv_bytes_per_token, same.host_weight_bytes) == \
        (whole.weight_bytes, whole.kv_bytes_per_token, 0)
    split = plan_capacity(m, num_device_layers=15, **kw)
    assert split.kv_bytes_per_token * 2 == whole.kv_bytes_per_token
    assert split.weight_bytes + split.host_weight_bytes == whole.weight_bytes
    assert split.num_blocks > whole.num_blocks and split.host_kv_bytes > 0
    layer = split.weight_bytes // 15
    off = plan_capacity(m, cpu_offload_gb=3.5 * layer / 1024**3, **kw)
    assert off.offloaded_layers == 3 and off.offload_bytes_per_forward == 3 * layer
    assert off.weight_bytes == whole.weight_bytes - layer  # 3 layers out, 2 staging slots in
    assert off.host_weight_bytes == 3 * layer and off.host_kv_bytes == 0
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        plan_capacity(m, cpu_offload_gb=100, **kw)
    with pytest.raises(ValueError, match="tp = pp = 1"):
        plan_capacity(m, num_device_layers=10, tp=3, **kw)

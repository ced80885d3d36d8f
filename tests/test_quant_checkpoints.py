"""Quantized safetensors checkpoints (GPTQ, AWQ, compressed-tensors) against transformers.

Each checkpoint is a tiny random Llama quantized here and written in the format's
layout (``tests/quant_checkpoints.py``: GPTQ / AWQ packed by hand after the
reference packers, compressed-tensors by its own compressors). Checks: the loader's
dequantized weights equal the format's formula bit for bit; the engine, loading the
packed checkpoint natively (int4 kernel, float32 activations), produces the same
greedy tokens as transformers on the dequantized weights; W8A8 matches a torch
reference with the same dynamic per-token int8 activations; bad input fails with a
ValueError naming the file and the problem.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.layers.linear import Linear, MergedColumnLinear
from llmserve.layers.quantization import resolve_quantization
from llmserve.layers.quantization.base import UnquantizedLinearMethod
from llmserve.layers.quantization.int_group import (
    GroupQuantizedTensor,
    Int4GroupLinearMethod,
    kernel_layout,
    pack_int4_groups,
)
from llmserve.layers.quantization.w8a8 import W8A8LinearMethod
from llmserve.loader.safetensors_loader import iter_safetensors_weights
from llmserve.worker.model_loading import model_weight_bytes
from tests.quant_checkpoints import hf_greedy, make_hf_llama, reference_model, write_checkpoint

try:
    import compressed_tensors  # noqa: F401 - the reference packer of its format
    HAS_CT = True
except ImportError:
    HAS_CT = False
needs_ct = pytest.mark.skipif(not HAS_CT, reason="needs the compressed-tensors package")

PROMPTS = [[5, 17, 99, 3, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [64]]
NEW_TOKENS = 12
FORMATS = {  # id: (format, options)
    "gptq-v1-g32": ("gptq", dict(group=32)),
    "gptq-v2-desc_act-g64-lm_head": ("gptq", dict(group=64, v2=True, desc_act=True,
                                                  lm_head=True)),
    "awq-g32": ("awq", dict(group=32)),
    "ct-w4a16-asym-g64": ("ct-w4a16", dict(group=64)),
    "ct-w4a16-sym-g128": ("ct-w4a16", dict(group=128, symmetric=True)),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one thread avoids waking OpenMP workers for every small op
    (seconds per test on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_llama()


def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, dtype=kw.pop("dtype", "float32"), kv_cache_memory="8MiB",
               max_model_len=64, **kw)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]




def _methods(llm: LLM) -> dict[str, str]:
    model = llm.engine.runner.model
    return {n: type(m.quant_method).__name__ for n, m in model.named_modules()
            if isinstance(m, Linear)}


@pytest.mark.parametrize("variant", [
    pytest.param(v, marks=needs_ct) if v.startswith("ct-") else v for v in FORMATS])
def test_native_greedy_equals_transformers(hf_model, tmp_path, variant):
    fmt, opts = FORMATS[variant]
    deq = write_checkpoint(hf_model, str(tmp_path), fmt, **opts)
    # the loader's dequantization (--quantization none path) is the formula, bit for bit
    loaded = {n[:-len(".weight")]: t for n, t in iter_safetensors_weights(str(tmp_path))
              if n[:-len(".weight")] in deq}
    assert loaded.keys() == deq.keys()
    for name, w in deq.items():
        assert torch.equal(loaded[name], w), name
    llm = _llm(str(tmp_path))
    methods = _methods(llm)
    assert set(methods.values()) == {"Int4GroupLinearMethod"} if opts.get("lm_head") else \
        {"Int4GroupLinearMethod", "UnquantizedLinearMethod"}
    assert methods["lm_head"] == ("Int4GroupLinearMethod" if opts.get("lm_head")
                                  else "UnquantizedLinearMethod")
    # the packed kernels count in the engine's weight bytes (KV budget, planner, advisor):
    # at least the 4-bit codes, well under the fp32 weights they replace
    model = llm.engine.runner.model
    dense = sum(p.numel() * p.element_size() for p in model.parameters()
                if p.device.type != "meta")
    packed = sum(deq[n].numel() for n, m in model.named_modules() if n in deq
                 and isinstance(m, Linear) and m.weight.device.type == "meta")
    assert dense + packed // 2 <= model_weight_bytes(model) < dense + packed * 4
    ref = reference_model(hf_model, deq)
    assert _greedy(llm) == hf_greedy(ref, PROMPTS, NEW_TOKENS)
    with torch.no_grad():  # the fp32 kernel's weights are exact: only summation order differs
        want = ref(torch.tensor([PROMPTS[1]])).logits[0, -1]
    torch.testing.assert_close(_prompt_logits(llm, PROMPTS[1]), want, rtol=1e-4, atol=1e-4)


def test_int4_packing_padding_act_order_and_fallback():
    """Rows padded to 16, act-order columns, kernel group < checkpoint group; fused shards
    whose act-order differs stay dense (one x permutation per matmul)."""
    torch.manual_seed(1)
    n, k, group = 40, 768, 384
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[torch.randperm(k)] = torch.arange(k) // group

    def tensor(g):
        return GroupQuantizedTensor(
            codes=torch.randint(0, 16, (n, k), dtype=torch.uint8),
            scales=torch.rand(n, k // group).half().float() / 10,
            zeros=torch.randint(0, 16, (n, k // group)).float(), group_size=group, bits=4,
            config=None, g_idx=g)

    a, b = tensor(g_idx), tensor(g_idx)
    assert kernel_layout(a)[1] == 128 and kernel_layout(a)[0] is not None
    packed = pack_int4_groups([a, b], kernel_layout(a)[0], 128, torch.float32)
    x = torch.randn(3, k)
    want = x @ torch.cat([a.dequantize(), b.dequantize()]).t()
    torch.testing.assert_close(packed.matmul(x), want, rtol=1e-5, atol=1e-5)
    layer = Linear(k, 2 * n)
    method = Int4GroupLinearMethod(None, layer)
    layer.quant_method = method
    method.load_weight(layer, a, 0)
    method.load_weight(layer, tensor(None), n)  # no act-order: a different column order
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    torch.testing.assert_close(layer(x)[:, :n], x @ a.dequantize().t(), rtol=1e-5, atol=1e-5)


def test_quantization_none_and_bf16(hf_model, tmp_path):
    """``--quantization none`` dequantizes at load (same tokens); bfloat16 runs the
    vectorized kernel with bf16-rounded scales (logits close to the fp32 kernel's)."""
    deq = write_checkpoint(hf_model, str(tmp_path), "awq", group=32)
    want = hf_greedy(reference_model(hf_model, deq), PROMPTS, NEW_TOKENS)
    dense = _llm(str(tmp_path), quantization="none")
    assert set(_methods(dense).values()) == {"UnquantizedLinearMethod"}
    assert _greedy(dense) == want
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    prompt = [{"prompt_token_ids": PROMPTS[1]}]
    bf16 = _llm(str(tmp_path), dtype="bfloat16")
    assert isinstance(bf16.engine.runner.model.model.layers[0].self_attn.qkv_proj.quant_method,
                      Int4GroupLinearMethod)
    lp32 = dense.generate(prompt, params, use_tqdm=False)[0].outputs[0].logprobs[0]
    lp16 = bf16.generate(prompt, params, use_tqdm=False)[0].outputs[0].logprobs[0]
    top = next(iter(lp32))
    assert top in lp16 and abs(lp16[top].logprob - lp32[top].logprob) < 0.15


def _int8_reference(hf_model, deq):
    """transformers with each quantized linear computing ``F.linear(dq(x), w)``, where
    ``dq(x)`` is symmetric per-token int8 fake quantization (scale max|x| / 127)."""
    ref = reference_model(hf_model, deq)

    def forward(self, x):
        xf = x.float()
        s = (xf.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-30)
        return torch.nn.functional.linear(torch.round(xf / s).clamp(-128, 127) * s,
                                          self.weight, self.bias)

    for name in deq:
        mod = ref.get_submodule(name)
        mod.forward = forward.__get__(mod)
    return ref


@needs_ct
def test_w8a8_dynamic_per_token(hf_model, tmp_path):
    deq = write_checkpoint(hf_model, str(tmp_path), "ct-w8a8")
    llm = _llm(str(tmp_path))
    methods = _methods(llm)
    assert {m for n, m in methods.items() if n != "lm_head"} == {"W8A8LinearMethod"}
    assert _greedy(llm) == hf_greedy(_int8_reference(hf_model, deq), PROMPTS, NEW_TOKENS)
    # logits: close to the same-quantization reference (float32 reordering flips a few
    # int8 roundings: measured 0.4% of the logit range); versus the dense model on the
    # dequantized weights the int8 activations cost more (measured 3.4% of the range)
    ids = torch.tensor(PROMPTS[1])
    with torch.no_grad():
        ref_q = _int8_reference(hf_model, deq)(ids[None]).logits[0]
        ref_dense = reference_model(hf_model, deq)(ids[None]).logits[0]
    model = llm.engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, W8A8LinearMethod)
    x = torch.randn(5, qkv.input_size)
    w = torch.cat([deq[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"])
    s = x.abs().amax(-1, keepdim=True) / 127
    want = torch.round(x / s).clamp(-128, 127) * s @ w.t()
    torch.testing.assert_close(qkv(x), want, rtol=1e-5, atol=1e-5)
    ours = _prompt_logits(llm, PROMPTS[1])
    spread = ref_dense[-1].max() - ref_dense[-1].min()
    assert (ours - ref_q[-1]).abs().max() < 0.01 * spread
    assert (ours - ref_dense[-1]).abs().max() < 0.05 * spread


def _prompt_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Last-position logits through the engine's model (one prefill on a fresh cache)."""
    from llmserve.layers.attention import CommonAttentionMetadata

    model = llm.engine.runner.model
    shape = model.get_kv_cache_shape(4, 16)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    common = CommonAttentionMetadata.from_lists([len(prompt)], [len(prompt)], [[0]], 16)
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), caches,
                       model.attn_backend_cls.build_metadata(common))
        return model.compute_logits(hidden)[-1]


# ----------------------------------------------------------------------------- bad input
def _edit_config(path, **fields):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"].update(fields)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def gptq_dir(hf_model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gptq"))
    write_checkpoint(hf_model, path, "gptq", group=32)
    return path


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def test_missing_shard(gptq_dir, tmp_path):
    path = _copy(gptq_dir, tmp_path / "m")
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match=r"missing.*model-00002-of-00002\.safetensors"):
        _llm(path)


def test_unknown_quant_method(gptq_dir, tmp_path):
    path = _copy(gptq_dir, tmp_path / "m")
    _edit_config(path, quant_method="bitsandbytes")
    with pytest.raises(ValueError, match=r"config\.json.*quant_method 'bitsandbytes' is not "
                                         r"supported; supported: \['awq', 'compressed-tensors'"):
        _llm(path)


@pytest.mark.parametrize("fields, message", [
    (dict(bits=3), r"config\.json: quantization_config\.bits must be one of \(2, 4, 8\)"),
    (dict(checkpoint_format="marlin"), r"checkpoint_format 'marlin' is not supported"),
])
def test_unsupported_gptq_field(gptq_dir, tmp_path, fields, message):
    path = _copy(gptq_dir, tmp_path / "m")
    _edit_config(path, **fields)
    with pytest.raises(ValueError, match=message):
        _llm(path)


def test_mismatched_or_malformed_tensors(gptq_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match=r"does not match the checkpoint's quant_method 'gptq'"):
        _llm(gptq_dir, quantization="awq")
    with pytest.raises(ValueError, match=r"awq needs a safetensors checkpoint"):
        resolve_quantization("awq", model_kind="gguf", dtype="bfloat16", device="cpu")
    path = _copy(gptq_dir, tmp_path / "m")
    for file in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        full = os.path.join(path, file)
        tensors = load_file(full)
        name = "model.layers.1.mlp.down_proj.qzeros"
        if name in tensors:
            tensors[name] = tensors[name][:, :-1].contiguous()  # one column of words short
            save_file(tensors, full)
    with pytest.raises(ValueError, match=r"safetensors'?: model\.layers\.1\.mlp\.down_proj: "
                                         r"qweight .* do not form a 4-bit GPTQ"):
        _llm(path)
    with open(os.path.join(path, "model-00001-of-00002.safetensors"), "r+b") as f:
        f.truncate(100)  # a cut download
    with pytest.raises(ValueError, match=r"model-00001-of-00002\.safetensors' is not a readable"):
        _llm(path)


@pytest.mark.parametrize("kernels", [True, False], ids=["q8-kernel", "no-kernels"])
def test_gptq_8bit_packs_for_q8_kernel(kernels, monkeypatch):
    """8-bit GPTQ words hold 4 fields (bits 8i); the layer runs on the C Q8_0 kernel
    (W8A16) where it is built, dense on the same formula where it is not."""
    from llmserve.layers.quantization import int8_group
    from llmserve.layers.quantization.gptq import GPTQConfig

    if not kernels:
        monkeypatch.setattr(int8_group, "get_cpu_kernels", lambda: None)
    elif int8_group.get_cpu_kernels() is None:
        pytest.skip("C kernels not built")
    torch.manual_seed(2)
    n, k, group = 16, 64, 32
    codes = torch.randint(0, 256, (k, n), dtype=torch.int64)  # [K, N] as GPTQ stores it
    zeros = torch.randint(1, 256, (k // group, n), dtype=torch.int64)
    scales = (torch.rand(k // group, n) / 100).half()
    qweight = sum(codes[i::4] << (8 * i) for i in range(4))  # [K / 4, N]
    stored = zeros - 1  # v1
    qzeros = sum(stored[:, i::4] << (8 * i) for i in range(4))  # [G, N / 4]
    cfg = GPTQConfig({"quant_method": "gptq", "bits": 8, "group_size": group}, "config.json")
    t = cfg.read_module("m", {"qweight": qweight.to(torch.uint32).view(torch.int32),
                              "qzeros": qzeros.to(torch.uint32).view(torch.int32),
                              "scales": scales})
    g = torch.arange(k) // group
    want = ((codes.float() - zeros[g].float()) * scales.float()[g]).t()
    assert torch.equal(t.dequantize(), want)
    layer = Linear(k, n)
    layer.weight_loader(layer.weight, t)
    x = torch.randn(3, k)
    if kernels:
        assert isinstance(layer.quant_method.kernel, int8_group.Int8GroupWeight)
        torch.testing.assert_close(layer(x), x @ want.t(), rtol=1e-4, atol=1e-4)
    else:
        assert isinstance(layer.quant_method, UnquantizedLinearMethod)
        assert torch.equal(layer.weight, want)


def test_w8a8_static_per_tensor_activations():
    """Static ``input_scale``: fused shards share the largest scale (as vLLM)."""
    from llmserve.layers.quantization.compressed_tensors import CompressedTensorsConfig

    act = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
           "dynamic": False}
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    cfg = CompressedTensorsConfig({"quant_method": "compressed-tensors",
                                   "format": "int-quantized", "config_groups": {"g": {
                                       "targets": ["Linear"], "weights": weights,
                                       "input_activations": act}}}, "config.json")
    torch.manual_seed(3)
    k, rows = 64, (32, 16)
    layer = MergedColumnLinear(k, list(rows))
    shards = []
    for i, (n, s_x) in enumerate(zip(rows, (0.02, 0.03), strict=True)):
        t = cfg.read_module(f"m{i}", {
            "weight": torch.randint(-128, 128, (n, k), dtype=torch.int8),
            "weight_scale": (torch.rand(n, 1) / 100).bfloat16(),
            "input_scale": torch.tensor([s_x], dtype=torch.bfloat16)})
        shards.append(t)
        layer.weight_loader(layer.weight, t, i)
    assert isinstance(layer.quant_method, W8A8LinearMethod)
    x = torch.randn(4, k)
    s_x = float(torch.tensor(0.03, dtype=torch.bfloat16))
    w = torch.cat([t.dequantize() for t in shards])
    want = torch.round(x / s_x).clamp(-128, 127) * s_x @ w.t()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"m0\.input_scale must hold one value"):
        cfg.read_module("m0", {"weight": torch.zeros(4, k, dtype=torch.int8),
                               "weight_scale": torch.ones(4, 1),
                               "input_scale": torch.ones(2)})

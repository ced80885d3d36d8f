"""Native GGUF weights (Q4_0, Q4_1, Q4_K, Q8_0 through torch's int4 CPU kernel; Q5_0,
Q5_K, Q6_K, Q8_0 through the C kernel gguf_matmul).

Unit tests build GGUF blocks with ``gguf.quants`` (llama.cpp's formulas) and by
hand; the float32 kernel must reproduce every dequantized weight bit for bit,
the bfloat16 kernel within the stated bound. A tiny GGUF model run natively in
float32 must match the dequantized model. The model tests check the real
SmolLM2 Q4_1 file and the Qwen2.5-Coder-1.5B Q4_K_M file: logits close to the
dequantized float32 path, perplexity within 0.5%.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from llmserve.kernels import get_cpu_kernels
from llmserve.layers.linear import Linear, MergedColumnLinear, QKVLinear
from llmserve.layers.quantization import get_quantization_config, resolve_quantization
from llmserve.layers.quantization.base import UnquantizedLinearMethod
from llmserve.layers.quantization.gguf_blocks import GGUFQuantizedTensor
from llmserve.layers.quantization.gguf_cpu import (
    FusedNativeWeight,
    q8k_enabled,
)
from llmserve.layers.quantization.gguf_native import (
    GGUFNativeConfig,
    GGUFNativeLinearMethod,
)
from llmserve.layers.quantization.int4pack import pack_gguf_shards
from llmserve.layers.quantization.int8_prefill import Int8PrefillWeight
from tests.test_kernels import random_gguf_blocks

RNG = np.random.default_rng(0)
FP32 = GGUFNativeConfig(torch.float32)


def quantized(qtype: str, rows: int, cols: int, config=FP32, scale=0.05) -> GGUFQuantizedTensor:
    x = (RNG.standard_normal((rows, cols)) * scale).astype(np.float32)
    raw = gguf.quants.quantize(x, getattr(Q, qtype)).reshape(rows, -1)
    return GGUFQuantizedTensor(qtype, (rows, cols), raw, config)


def hand_blocks(qtype: str, rows: int, cols: int) -> GGUFQuantizedTensor:
    """Blocks with arbitrary fp16 d and m (not what a quantizer would pick)."""
    n = rows * cols // 32
    d = RNG.uniform(-2, 2, (n, 1)).astype(np.float16)
    m = RNG.uniform(-2, 2, (n, 1)).astype(np.float16)
    if qtype == "Q8_0":
        q = RNG.integers(-128, 128, (n, 32)).astype(np.int8).view(np.uint8)
        parts = [d.view(np.uint8), q]
    else:
        q = RNG.integers(0, 16, (n, 32), dtype=np.uint8)
        parts = [d.view(np.uint8)] + ([m.view(np.uint8)] if qtype == "Q4_1" else []) + [
            q[:, :16] | (q[:, 16:] << 4)]
    raw = np.concatenate(parts, axis=1).reshape(rows, -1)
    return GGUFQuantizedTensor(qtype, (rows, cols), raw, FP32)


def k_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> GGUFQuantizedTensor:
    """Hand-made K-quant / Q5_0 blocks: random bytes, finite fp16 scales (gguf-py has no
    K-quant quantizer); weights scaled down so a tiny model's activations stay tame."""
    raw = random_gguf_blocks(qtype, rows, cols, seed)
    return GGUFQuantizedTensor(qtype, (rows, cols), raw, FP32)


def exact_q4_k(rows: int, cols: int, seed: int = 0) -> GGUFQuantizedTensor:
    """Q4_K blocks whose int4 zero points are exact in float32: dmin = d 2^k, |k| <= 3
    (within a few binades, as quantizers write them; true of every real file seen)."""
    t = k_blocks("Q4_K", rows, cols, seed)
    b = t.blocks.reshape(rows, cols // 256, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    dmin = (d * np.exp2(RNG.integers(-3, 4, d.shape))).astype(np.float16)
    b[..., 2:4] = dmin.view(np.uint8).reshape(rows, cols // 256, 2)
    return t


# ---------------------------------------------------------------- blocks and packing
def test_q4_k_unpack_and_float32_int4_kernel_bit_exact():
    """Q4_K super-block = 8 groups of 32 with s = d sc_j, z = -dmin m_j + 8 s: the int4
    kernel's float32 weights equal gguf.quants' Q4_K formula bit for bit (where z is
    exact in float32: dmin within a few binades of d, as quantizers write it)."""
    t = exact_q4_k(24, 512)
    ref = t.dequantize()
    u = t.unpack()
    assert u.codes.shape == (24, 512) and u.d.shape == (24, 16)
    assert np.array_equal(u.dequantize(), ref.numpy())
    packed = pack_gguf_shards([u], torch.float32)
    assert not packed.wide
    assert torch.equal(packed.matmul(torch.eye(512)).t(), ref)


def test_c_kernel_types_do_not_unpack():
    with pytest.raises(ValueError, match="Q6_K"):
        k_blocks("Q6_K", 4, 256).unpack()
    with pytest.raises(ValueError, match="do not hold"):
        GGUFQuantizedTensor("Q6_K", (4, 256), np.zeros((4, 200), np.uint8), FP32)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("make", [quantized, hand_blocks])
def test_unpack_and_float32_kernel_bit_exact(qtype, make):
    t = make(qtype, 24, 96)  # 24 rows: padded to 32 for the kernel
    ref = t.dequantize()  # gguf.quants (llama.cpp formulas)
    assert np.array_equal(t.unpack().dequantize(), ref.numpy())
    packed = pack_gguf_shards([t.unpack()], torch.float32)
    deq = packed.matmul(torch.eye(96)).t()  # the kernel's dequantized weight, column by column
    assert torch.equal(deq, ref)


def test_fused_mixed_shards_bit_exact():
    shards = [quantized("Q4_1", 32, 64), hand_blocks("Q8_0", 16, 64), quantized("Q4_0", 8, 64)]
    packed = pack_gguf_shards([s.unpack() for s in shards], torch.float32)
    assert packed.wide  # a Q8_0 row doubles the input for every row
    ref = torch.cat([s.dequantize() for s in shards])
    assert torch.equal(packed.matmul(torch.eye(64)).t(), ref)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_bfloat16_kernel_within_scale_rounding_bound(qtype):
    """bf16 scales: w' = bf16(d) (q - 8) + bf16(z), so |w' - w| <= 2**-8 (|q-8||d| + |z|)."""
    t = quantized(qtype, 32, 64)
    u = t.unpack()
    packed = pack_gguf_shards([u], torch.bfloat16)
    x = torch.randn(3, 64)
    y = packed.matmul(x.bfloat16()).float()
    xr = x.bfloat16().float()
    q = torch.from_numpy(u.codes.astype(np.float32)).view(32, 2, 32)
    d = torch.from_numpy(u.d)[..., None].abs()
    if qtype == "Q8_0":
        bound = 2.0**-8 * (q.abs() * d)
    else:
        z = torch.from_numpy(u.m)[..., None] + 8 * torch.from_numpy(u.d)[..., None] \
            if qtype == "Q4_1" else torch.zeros_like(d)
        bound = 2.0**-8 * ((q - 8).abs() * d + z.abs())
    # |x (w' - w)| <= |x| bound, plus bf16 rounding of the output
    tol = xr.abs() @ bound.view(32, 64).t() + 2.0**-8 * (xr @ t.dequantize().t()).abs() + 1e-6
    assert ((y - xr @ t.dequantize().t()).abs() <= tol).all()


# ---------------------------------------------------------------- layers
def test_linear_switches_method_and_fuses_shards():
    layer = QKVLinear(64, 16, 4, 2, bias=True)
    shards = {"q": quantized("Q4_1", 64, 64), "k": quantized("Q4_0", 32, 64),
              "v": quantized("Q8_0", 32, 64)}
    for sid in ("v", "q", "k"):  # any order
        layer.weight_loader(layer.weight, shards[sid], sid)
        layer.weight_loader(layer.bias, torch.randn(shards[sid].shape[0]), sid)
    assert isinstance(layer.quant_method, GGUFNativeLinearMethod)
    assert layer.weight.device.type == "meta"  # packed only: no dense copy
    dense = torch.cat([shards[s].dequantize() for s in ("q", "k", "v")])
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), F.linear(x, dense, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_k_quant_layer_runs_each_part_in_its_kernel(dtype, exact):
    """A Q4_K_M-style qkv (Q4_K q, k + Q6_K v) and a Q5_0/Q5_K/Q8_0 gate_up: one weight
    per kernel, outputs side by side, equal to the dequantized layer."""
    if get_cpu_kernels() is None:
        pytest.skip("no C kernels: Q6_K layers stay dense")
    config = GGUFNativeConfig(dtype)
    assert {"Q4_K", "Q5_0", "Q5_K", "Q6_K"} <= config.gguf_raw_types
    layer = QKVLinear(256, 64, 4, 2, bias=True, dtype=dtype)
    q4_k = exact_q4_k if exact else lambda *a: k_blocks("Q4_K", *a)
    shards = {"q": q4_k(256, 256, 1), "k": q4_k(128, 256, 2), "v": k_blocks("Q6_K", 128, 256, 3)}
    for sid in ("k", "v", "q"):
        shards[sid].config = config
        layer.weight_loader(layer.weight, shards[sid], sid)
        layer.weight_loader(layer.bias, torch.randn(shards[sid].shape[0]), sid)
    packed = layer.quant_method.packed
    assert isinstance(packed, FusedNativeWeight)
    # exact zero points: q, k in the int4 kernel; random fp16 d, dmin (a subnormal among
    # them): inexact, q and k fall back to gguf_matmul. v (Q6_K) is in gguf_matmul.
    # bfloat16 on an AVX512-VNNI CPU: Q4_K and Q6_K in gguf_matmul_x16 (int8 activations).
    kinds = [getattr(p, "qtype", "int4") for p in packed.parts]
    q8k = q8k_enabled(dtype)
    assert kinds == (["int4", "Q6_K"] if exact and not q8k else ["Q4_K", "Q6_K"])
    assert [getattr(p, "int8_activations", False) for p in packed.parts] == [q8k, q8k]
    dense = torch.cat([shards[s].dequantize() for s in ("q", "k", "v")])
    for rows in (1, 5, 20):
        x = torch.randn(rows, 256).to(dtype)
        want = F.linear(x.double(), dense.double(), layer.bias.double())
        tol = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(layer(x).double(), want, rtol=tol,
                                   atol=tol * want.abs().max().item())
        torch.testing.assert_close(layer.matmul_fn()(x), layer(x), rtol=0, atol=0)
    mlp = MergedColumnLinear(256, [64, 64, 32], dtype=dtype)
    parts = [k_blocks(t, r, 256, i) for i, (t, r) in enumerate(
        [("Q5_0", 64), ("Q5_K", 64), ("Q8_0", 32)])]
    for i, t in enumerate(parts):
        t.config = config
        mlp.weight_loader(mlp.weight, t, i)
    assert [p.qtype for p in mlp.quant_method.packed.parts] == ["Q5_0", "Q5_K", "Q8_0"]
    x = torch.randn(3, 256).to(dtype)
    want = x.double() @ torch.cat([t.dequantize() for t in parts]).double().T
    torch.testing.assert_close(mlp(x).double(), want, rtol=2 ** -6 if dtype == torch.bfloat16
                               else 1e-5, atol=2 ** -6 * want.abs().max().item())


def test_mixed_native_and_float_shards_stay_dense():
    layer = QKVLinear(64, 16, 4, 2)
    k_float = torch.randn(32, 64)
    layer.weight_loader(layer.weight, k_float, "k")  # e.g. a Q6_K shard, dequantized
    q, v = quantized("Q4_1", 64, 64), quantized("Q4_0", 32, 64)
    layer.weight_loader(layer.weight, q, "q")
    layer.weight_loader(layer.weight, v, "v")
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    assert torch.equal(layer.weight.data, torch.cat([q.dequantize(), k_float, v.dequantize()]))


@pytest.mark.parametrize("prefill_weights", ["int8", "dense"])
def test_hybrid_uses_prompt_copy_for_prompt_rows_packed_for_decode_rows(prefill_weights):
    config = GGUFNativeConfig(torch.float32, dense_prefill=True, prefill_weights=prefill_weights)
    t = quantized("Q4_1", 32, 64, config)
    layer = Linear(64, 32)
    layer.weight_loader(layer.weight, t)
    if prefill_weights == "dense":
        assert torch.equal(layer.weight.data, t.dequantize())  # the dense copy
        assert layer.quant_method.int8 is None
    else:  # int8 codes of the dequantized values, no dense copy
        assert layer.weight.device.type == "meta"
        want = Int8PrefillWeight.from_float(t.dequantize())
        assert torch.equal(layer.quant_method.int8.codes, want.codes)
    x = torch.randn(3, 64)
    packed = layer.quant_method.packed.matmul
    for rows in (1, 3):  # the decode path's closure: the packed kernel at any M
        assert torch.equal(layer.matmul_fn()(x[:rows]), packed(x[:rows]))
    layer.quant_method.packed = None  # the module path (prompt rows) never touches it
    for rows in (1, 2, 3):
        want = F.linear(x[:rows], t.dequantize())
        if prefill_weights == "dense":
            torch.testing.assert_close(layer(x[:rows]), want)
        else:
            assert torch.equal(layer(x[:rows]), layer(x)[:rows])  # rows independent
            torch.testing.assert_close(layer(x[:rows]), want, rtol=0.05,
                                       atol=0.02 * want.abs().max().item())


def test_hybrid_int8_keeps_a_dense_untied_lm_head():
    """process_model: the LM head's prompt-row copy is dense (logits stay unquantized)."""
    config = GGUFNativeConfig(torch.float32, dense_prefill=True, prefill_weights="int8")
    model = torch.nn.Module()
    model.proj, model.lm_head = Linear(64, 32), Linear(64, 48)
    srcs = {"proj": quantized("Q4_1", 32, 64, config), "lm_head": quantized("Q4_0", 48, 64,
                                                                            config)}
    for name, t in srcs.items():
        getattr(model, name).weight_loader(getattr(model, name).weight, t)
    config.process_model(model)
    head, proj = model.lm_head.quant_method, model.proj.quant_method
    assert head.int8 is None and head.sources is None and proj.sources is None
    assert torch.equal(model.lm_head.weight.data, srcs["lm_head"].dequantize())
    assert proj.int8 is not None and model.proj.weight.device.type == "meta"
    x = torch.randn(3, 64)
    torch.testing.assert_close(model.lm_head(x), F.linear(x, srcs["lm_head"].dequantize()))


def test_hybrid_untied_lm_head_of_blocks_runs_them_for_every_row():
    """gguf-hybrid: an untied Q6_K LM head drops its dense copy in process_model and runs
    the blocks' kernel for prompt and decode rows alike (the same bits for any M)."""
    if get_cpu_kernels() is None:
        pytest.skip("no C kernels: Q6_K layers stay dense")
    config = GGUFNativeConfig(torch.bfloat16, dense_prefill=True)
    model = torch.nn.Module()
    model.lm_head = Linear(256, 64, dtype=torch.bfloat16)
    t = k_blocks("Q6_K", 64, 256, 4)
    t.config = config
    model.lm_head.weight_loader(model.lm_head.weight, t)
    assert model.lm_head.weight.device.type == "cpu"  # the dense copy, until process_model
    config.process_model(model)
    head = model.lm_head
    assert head.weight.device.type == "meta" and head.quant_method.packed_all_rows
    x = torch.randn(20, 256).bfloat16()
    rows = torch.cat([head(x[i:i + 1]) for i in range(20)])
    assert torch.equal(head(x), rows) and torch.equal(head.matmul_fn()(x[:3]), rows[:3])
    want = x.double() @ t.dequantize().double().T
    torch.testing.assert_close(rows.double(), want, rtol=2 ** -6,
                               atol=2 ** -6 * want.abs().max().item())


def test_resolve_quantization():
    assert resolve_quantization("auto", model_kind="gguf", dtype="bfloat16",
                                device="cpu").name == "gguf-hybrid"
    assert resolve_quantization("auto", model_kind="gguf", dtype="float32", device="cpu") is None
    assert resolve_quantization("auto", model_kind="hf", dtype="bfloat16", device="cpu") is None
    assert not get_quantization_config("gguf-native").dense_prefill
    assert resolve_quantization("auto", model_kind="gguf", dtype="bfloat16", device="cpu",
                                deterministic=True).name == "gguf-native"
    q4_k_m = {"Q4_K", "Q6_K", "F32"}  # a Q4_K_M file: native with the C kernels (Q6_K)
    auto = resolve_quantization("auto", model_kind="gguf", dtype="bfloat16", device="cpu",
                                gguf_types=q4_k_m)
    assert (auto is not None) == (get_cpu_kernels() is not None)
    assert auto is None or q4_k_m - {"F32"} <= auto.gguf_raw_types
    assert resolve_quantization("auto", model_kind="gguf", dtype="bfloat16", device="cpu",
                                gguf_types={"Q4_K", "Q3_K", "F32"}) is None  # no Q3_K kernel
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        resolve_quantization("gguf-native", model_kind="gguf", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="GGUF model"):
        resolve_quantization("gguf-hybrid", model_kind="hf", dtype="bfloat16", device="cpu")
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_quantization("bitsandbytes", model_kind="gguf", dtype="bfloat16", device="cpu")

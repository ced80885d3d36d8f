"""8-bit group-quantized layers (GPTQ / compressed-tensors W8A16) on the Q8_0 C kernel.

Oracle: ``x @ t.dequantize().T`` in float64, the checkpoint's own formula
``w = (q - z) * s`` (int_group.py). The kernel path (``Int8GroupWeight``) must match it
to float32 summation order for symmetric and asymmetric zero points, per-row and
32/64/128-column groups, act-order ``g_idx``, fused row shards, bfloat16 and float32
activations and 1..40 rows; layouts the kernel cannot run stay dense and still match.
"""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import get_cpu_kernels
from llmserve.layers.linear import Linear, MergedColumnLinear
from llmserve.layers.quantization import int8_group
from llmserve.layers.quantization.base import UnquantizedLinearMethod
from llmserve.layers.quantization.int8_group import Int8GroupWeight
from llmserve.layers.quantization.int_group import GroupQuantizedTensor, Int4GroupLinearMethod

needs_kernels = pytest.mark.skipif(get_cpu_kernels() is None, reason="needs the C kernels")


def _tensor(n: int, k: int, group: int, *, symmetric: bool = False, act_order: bool = False,
            seed: int = 0) -> GroupQuantizedTensor:
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    g_idx = None
    if act_order:  # GPTQ desc_act: every group keeps its size, columns are shuffled
        g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)]
    zeros = torch.full((n, groups), 128.0) if symmetric else \
        torch.randint(1, 256, (n, groups), generator=gen).float()
    return GroupQuantizedTensor(
        codes=torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen),
        scales=(torch.rand(n, groups, generator=gen) / 50 + 1e-3).half().float(),
        zeros=zeros, group_size=group, bits=8, config=None, g_idx=g_idx)


def _load(layer, shards) -> None:
    layer.quant_method = Int4GroupLinearMethod(None, layer)
    offset = 0
    for t in shards:
        layer.quant_method.load_weight(layer, t, offset)
        offset += t.shape[0]


def _check(layer, shards, rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, shards[0].shape[1]).to(dtype)
    want = x.double() @ torch.cat([t.dequantize() for t in shards]).double().t()
    got = layer(x)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4  # bf16 output rounding / fp32 sums
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group,symmetric,act_order", [
    (32, False, False), (64, True, False), (128, False, True), (256, True, False),
    (64, False, True)], ids=["g32", "g64-sym", "g128-act", "row-sym", "g64-act"])
def test_int8_layer_runs_on_kernel_and_matches_formula(group, symmetric, act_order, dtype):
    n, k = 48, 256
    t = _tensor(n, k, group, symmetric=symmetric, act_order=act_order)
    layer = Linear(k, n, dtype=dtype)
    _load(layer, [t])
    kernel = layer.quant_method.kernel
    assert isinstance(kernel, Int8GroupWeight)
    assert layer.weight.device.type == "meta"  # no dense copy is kept
    assert (kernel.offsets is None) == symmetric
    assert (kernel.perm is None) == (not act_order)
    # 1 byte a weight + one float32 scale per 32 (+ one offset per group when asymmetric)
    assert kernel.nbytes() == n * k + n * k // 32 * 4 + (0 if symmetric else n * k // group * 4)
    for rows in (1, 5, 40):  # 40: split into 16-row kernel calls
        _check(layer, [t], rows, dtype)


@needs_kernels
def test_int8_fused_shards_share_one_kernel():
    """q/k/v-style fused rows: shards stack into one weight (asymmetric + symmetric)."""
    k = 128
    shards = [_tensor(32, k, 32, seed=1), _tensor(16, k, 32, symmetric=True, seed=2)]
    layer = MergedColumnLinear(k, [32, 16], dtype=torch.bfloat16)
    _load(layer, shards)
    assert isinstance(layer.quant_method.kernel, Int8GroupWeight)
    _check(layer, shards, 3, torch.bfloat16)


@pytest.mark.parametrize("case", ["group16", "k48", "fp16", "mixed-act-order", "no-kernels"])
def test_int8_layouts_the_kernel_cannot_run_stay_dense(case, monkeypatch):
    k, dtype = 128, torch.float32
    shards = [_tensor(32, k, 32)]
    if case == "group16":
        shards = [_tensor(32, k, 16)]
    elif case == "k48":
        k, shards = 48, [_tensor(32, 48, 16)]
    elif case == "fp16":
        dtype = torch.float16
    elif case == "mixed-act-order":
        shards = [_tensor(16, k, 32, act_order=True, seed=3), _tensor(16, k, 32, seed=4)]
    else:
        monkeypatch.setattr(int8_group, "get_cpu_kernels", lambda: None)
    layer = (Linear(k, 32, dtype=dtype) if len(shards) == 1 else
             MergedColumnLinear(k, [16, 16], dtype=dtype))
    _load(layer, shards)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    want = torch.cat([t.dequantize() for t in shards]).to(dtype)
    assert torch.equal(layer.weight, want)
    if dtype != torch.float16:
        _check(layer, shards, 2, dtype)

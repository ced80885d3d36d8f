"""Small quantized safetensors checkpoints for the tests (GPTQ, AWQ, compressed-tensors).

A tiny random Llama is built in transformers; its decoder linear weights are
quantized round-to-nearest here (``rtn``) and written in each format's documented
layout: GPTQ and AWQ packed by hand after AutoGPTQ's ``QuantLinear.pack`` and
AutoAWQ's ``WQLinear_GEMM.from_linear`` (this file's packers share no code with
llmserve's readers), compressed-tensors by the ``compressed-tensors`` package's
own compressors. :func:`write_checkpoint` returns the dequantized weights the
format's formula gives, for the transformers reference model.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SMALL = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-5)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def make_hf_llama(**extra) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(**SMALL, **extra)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def quantized_modules(model, lm_head: bool = False) -> dict[str, torch.Tensor]:
    """HF module name -> float32 weight ``[N, K]`` of every linear to quantize."""
    out = {f"{name}": mod.weight.detach().float() for name, mod in model.named_modules()
           if name.rsplit(".", 1)[-1] in LINEARS}
    if lm_head:
        out["lm_head"] = model.lm_head.weight.detach().float()
    return out


def rtn(w: torch.Tensor, group: int, g_idx: torch.Tensor | None = None,
        scale_dtype=torch.float16):
    """Asymmetric 4-bit round-to-nearest: codes uint8 ``[N, K]`` in 0..15, scales
    ``[N, G]`` (``scale_dtype``), integer zeros ``[N, G]``; column k uses group g_idx[k]."""
    n, k = w.shape
    g_idx = torch.arange(k) // group if g_idx is None else g_idx
    groups = int(g_idx.max()) + 1
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-4).to(scale_dtype).float()
        scales[:, g], zeros[:, g] = s, torch.round(-lo / s).clamp(0, 15)
    s_col, z_col = scales[:, g_idx], zeros[:, g_idx]
    codes = torch.clamp(torch.round(w / s_col) + z_col, 0, 15).to(torch.uint8)
    return codes, scales.to(scale_dtype), zeros.to(torch.int32), g_idx


def dequant(codes, scales, zeros, g_idx) -> torch.Tensor:
    return (codes.float() - zeros[:, g_idx].float()) * scales.float()[:, g_idx]


def pack_rows(values: np.ndarray) -> np.ndarray:
    """uint ``[R, C]`` 4-bit -> int32 ``[R / 8, C]``: word j holds rows 8j..8j+7 (bits 4i)."""
    v = values.astype(np.uint32).reshape(-1, 8, values.shape[1])
    out = np.zeros((v.shape[0], v.shape[2]), np.uint32)
    for i in range(8):
        out |= v[:, i, :] << np.uint32(4 * i)
    return out.view(np.int32)


def pack_cols(values: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """uint ``[R, C]`` 4-bit -> int32 ``[R, C / 8]``: nibble i of word j = column 8j + order[i]."""
    v = values.astype(np.uint32)
    out = np.zeros((v.shape[0], v.shape[1] // 8), np.uint32)
    for i in range(8):
        out |= v[:, [8 * j + order[i] for j in range(v.shape[1] // 8)]] << np.uint32(4 * i)
    return out.view(np.int32)


def gptq_tensors(w, group, v2: bool, desc_act: bool, seed: int):
    n, k = w.shape
    g_idx = None
    if desc_act:  # act-order: groups along a random column order (one per layer input,
        # as GPTQ's Hessian order is shared by q/k/v and by gate/up)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[perm] = torch.arange(k) // group
    codes, scales, zeros, g_idx = rtn(w, group, g_idx)
    stored_z = zeros if v2 else (zeros - 1) & 15  # v1 stores z - 1 (AutoGPTQ)
    t = {"qweight": torch.from_numpy(pack_rows(codes.t().numpy())),
         "qzeros": torch.from_numpy(pack_cols(stored_z.t().numpy())),
         "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}
    return t, dequant(codes, scales, zeros, g_idx)


def awq_tensors(w, group):
    codes, scales, zeros, g_idx = rtn(w, group)
    t = {"qweight": torch.from_numpy(pack_cols(codes.t().numpy(), AWQ_ORDER)),
         "qzeros": torch.from_numpy(pack_cols(zeros.t().numpy(), AWQ_ORDER)),
         "scales": scales.t().contiguous()}
    return t, dequant(codes, scales, zeros, g_idx)


def ct_w4a16_scheme(group: int, symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group))


def ct_tensors(w, scheme, fmt: str):
    """compressed-tensors' own compressor (and decompressor, in float32) for one weight."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    wargs = scheme.weights
    if fmt == "pack-quantized":
        codes, scales, zeros, _ = rtn(w, wargs.group_size, scale_dtype=torch.bfloat16)
        zp = (zeros - 8).to(torch.int8)
        if wargs.symmetric:  # symmetric: zero point 0 (signed), scale from max |w|
            scales = (w.abs().reshape(w.shape[0], -1, wargs.group_size).amax(-1) / 7.5
                      ).clamp(min=1e-4).to(torch.bfloat16)
            zp = None
        state = {"weight": w, "weight_scale": scales}
        if zp is not None:
            state["weight_zero_point"] = zp
        comp = PackedQuantizationCompressor
    else:  # int-quantized W8A8: per-channel symmetric int8
        scales = (w.abs().amax(1, keepdim=True) / 127).to(torch.bfloat16)
        state, comp = {"weight": w, "weight_scale": scales}, IntQuantizationCompressor
    packed = comp.compress(dict(state), scheme)
    ref = {k: (v.float() if k == "weight_scale" else v) for k, v in packed.items()}
    return packed, comp.decompress(ref, scheme)["weight"].float()


def _input_id(name: str) -> int:
    """Modules reading the same input share an id (q/k/v; gate/up)."""
    prefix, proj = name.rsplit(".", 1) if "." in name else ("", name)
    kind = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj)
    return sum(map(ord, prefix + kind))


def write_checkpoint(model, path: str, fmt: str, **opts) -> dict[str, torch.Tensor]:
    """Write ``model`` as a ``fmt`` checkpoint (``gptq``, ``awq``, ``ct-w4a16``, ``ct-w8a8``)
    in two shards with an index (one module's tensors split across them), plus a
    WordLevel tokenizer; returns HF module name -> dequantized float32 weight."""
    os.makedirs(path, exist_ok=True)
    group = opts.get("group", 32)
    dense = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    targets = quantized_modules(model, lm_head=opts.get("lm_head", False))
    qcfg: dict = {}
    if fmt == "gptq":
        qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": False,
                "desc_act": opts.get("desc_act", False), "lm_head": opts.get("lm_head", False),
                "checkpoint_format": "gptq_v2" if opts.get("v2") else "gptq"}
    elif fmt == "awq":
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm"}
    else:
        from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

        scheme = (ct_w4a16_scheme(group, opts.get("symmetric", False)) if fmt == "ct-w4a16"
                  else preset_name_to_scheme("W8A8", ["Linear"]))
        ct_fmt = "pack-quantized" if fmt == "ct-w4a16" else "int-quantized"
        qcfg = QuantizationConfig(config_groups={"group_0": scheme}, format=ct_fmt,
                                  ignore=["lm_head"], quantization_status="compressed"
                                  ).model_dump(mode="json")
    deq = {}
    for name, w in targets.items():
        del dense[f"{name}.weight"]
        if fmt == "gptq":
            t, deq[name] = gptq_tensors(w, group, opts.get("v2", False),
                                        opts.get("desc_act", False), seed=_input_id(name))
        elif fmt == "awq":
            t, deq[name] = awq_tensors(w, group)
        else:
            t, deq[name] = ct_tensors(w, scheme, ct_fmt)
        dense.update({f"{name}.{k}": v.contiguous() for k, v in t.items()})
    names = sorted(dense)
    cuts = [i for i, n in enumerate(names) if n.endswith((".qzeros", ".weight_scale"))]
    split = min(cuts, key=lambda i: abs(i - len(names) // 2))  # a module straddles the shards
    shards = {"model-00001-of-00002.safetensors": names[:split],
              "model-00002-of-00002.safetensors": names[split:]}
    for file, keys in shards.items():
        save_file({k: dense[k] for k in keys}, os.path.join(path, file))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {k: file for file, keys in shards.items() for k in keys}}, f)
    config = model.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config["quantization_config"] = qcfg
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_tokenizer(path, model.config.vocab_size)
    return deq


def save_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0",
                                                eos_token=f"t{vocab_size - 1}")
    fast.save_pretrained(path)


def reference_model(model, deq: dict[str, torch.Tensor]):
    """A copy of ``model`` in float32 whose quantized linears hold the dequantized weights."""
    ref = make_hf_llama(**{k: getattr(model.config, k) for k in ("tie_word_embeddings",)})
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, w in deq.items():
            ref.get_submodule(name).weight.copy_(w)
    return ref.float().eval()


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one full forward per token
    (no generate()): the oracle the checkpoint tests compare llmserve against."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out

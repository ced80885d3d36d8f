"""Native GGUF weights on whole models: a tiny GGUF model (K-quants, float32) run
natively must match the dequantized model; the real SmolLM2 Q4_1 file and the
Qwen2.5-Coder-1.5B Q4_K_M file give logits close to the dequantized float32 path and
perplexity within 0.5%. (Blocks, kernels and layers: tests/test_quant_gguf.py.)
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llmserve.kernels import get_cpu_kernels
from llmserve.layers.attention import CommonAttentionMetadata
from llmserve.layers.linear import Linear
from llmserve.layers.quantization import get_quantization_config
from llmserve.layers.quantization.gguf_cpu import (
    GGUFBlockWeight,
    q8k_enabled,
)
from llmserve.layers.quantization.gguf_native import (
    GGUFNativeConfig,
    GGUFNativeLinearMethod,
    NativeLMHeadWeight,
)
from llmserve.loader import ModelSource, iter_weights, load_model_config
from llmserve.models import get_model_class
from llmserve.tokenizer import load_tokenizer
from tests.test_kernels import random_gguf_blocks

RNG = np.random.default_rng(0)


# ---------------------------------------------------------------- a tiny GGUF model
def _permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_tiny_gguf(path) -> str:
    """1 layer, hidden 64, 4 heads (2 KV), vocab 64, tied Q8_0 embedding, Q4 layers.

    The weights come from their own seeded generator: the same file whatever ran before.
    """
    hidden, ffn, vocab = 64, 96, 64
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, 1), (w.add_context_length, 128),
                   (w.add_embedding_length, hidden), (w.add_feed_forward_length, ffn),
                   (w.add_head_count, 4), (w.add_head_count_kv, 2), (w.add_vocab_size, vocab)):
        add(v)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)

    def add(name, shape, qtype=None, scale=0.2):
        x = (rng.standard_normal(shape) * scale + (1.0 if "norm" in name else 0)).astype(np.float32)
        if "attn_q" in name:
            x = _permute(x, 4)
        elif "attn_k" in name:
            x = _permute(x, 2)
        w.add_tensor(name, gguf.quants.quantize(x, qtype) if qtype else x, raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), Q.Q8_0, 1.0)
    add("blk.0.attn_norm.weight", (hidden,))
    add("blk.0.attn_q.weight", (hidden, hidden), Q.Q4_1)
    add("blk.0.attn_k.weight", (32, hidden), Q.Q4_0)
    add("blk.0.attn_v.weight", (32, hidden), Q.Q4_1)
    add("blk.0.attn_output.weight", (hidden, hidden), Q.Q8_0)
    add("blk.0.ffn_norm.weight", (hidden,))
    add("blk.0.ffn_gate.weight", (ffn, hidden), Q.Q4_1)
    add("blk.0.ffn_up.weight", (ffn, hidden), Q.Q4_0)
    add("blk.0.ffn_down.weight", (hidden, ffn), Q.Q4_1)
    add("output_norm.weight", (hidden,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def write_tiny_k_quant_gguf(path) -> str:
    """1 layer, hidden 256, untied Q6_K output, Q4_K_M-like mixed layers (hand-made blocks)."""
    hidden, ffn, vocab = 256, 512, 64
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, 1), (w.add_context_length, 128),
                   (w.add_embedding_length, hidden), (w.add_feed_forward_length, ffn),
                   (w.add_head_count, 4), (w.add_head_count_kv, 2), (w.add_vocab_size, vocab)):
        add(v)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    tensors = [("token_embd", (vocab, hidden), "Q4_K"), ("blk.0.attn_q", (hidden, hidden), "Q4_K"),
               ("blk.0.attn_k", (128, hidden), "Q4_K"), ("blk.0.attn_v", (128, hidden), "Q6_K"),
               ("blk.0.attn_output", (hidden, hidden), "Q5_K"),
               ("blk.0.ffn_gate", (ffn, hidden), "Q8_0"), ("blk.0.ffn_up", (ffn, hidden), "Q4_K"),
               ("blk.0.ffn_down", (hidden, ffn), "Q6_K"), ("output", (vocab, hidden), "Q6_K")]
    for i, (name, shape, qtype) in enumerate(tensors):
        raw = random_gguf_blocks(qtype, *shape, seed=10 + i, scale=2e-4)
        w.add_tensor(f"{name}.weight", raw, raw_dtype=getattr(Q, qtype))
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w.add_tensor(f"{name}.weight", (1 + 0.1 * RNG.standard_normal(hidden)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_tiny_k_quant_model_native_equals_dequantized(tmp_path):
    """Every K-quant layer native (float32 activations) == the dequantized model; the
    untied Q6_K LM head runs through its linear method."""
    if get_cpu_kernels() is None:
        pytest.skip("no C kernels: the Q5/Q6 layers stay dense")
    source = ModelSource("gguf", write_tiny_k_quant_gguf(tmp_path / "k.gguf"), "tiny-k")
    dense = load_model(source, None, torch.float32)
    native = load_model(source, GGUFNativeConfig(torch.float32), torch.float32)
    for lin in (*native.model.layers[0].modules(), native.lm_head):
        if isinstance(lin, Linear):
            assert isinstance(lin.quant_method, GGUFNativeLinearMethod)
            assert lin.weight.device.type == "meta"
    ids = RNG.integers(0, 64, 20).tolist()
    ref = sequence_logits(dense, ids, 20)
    for chunk in (20, 1):
        torch.testing.assert_close(sequence_logits(native, ids, chunk), ref, rtol=0,
                                   atol=1e-4 * ref.abs().max().item())


def load_model(source, quant, dtype):
    config = load_model_config(source)
    model = get_model_class(config.architecture)(config, dtype)
    model.load_weights(iter_weights(source, config, quantization=quant))
    if quant is not None:
        quant.process_model(model)
    return model.eval()


def sequence_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    """Float32 logits ``[len(ids), vocab]``, prefilling ``chunk`` tokens per step."""
    bs, nb = 16, -(-len(ids) // 16)
    shape = model.get_kv_cache_shape(nb + 1, bs)
    kv = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
          for _ in range(model.num_layers)]
    out = []
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            e = min(len(ids), s + chunk)
            common = CommonAttentionMetadata.from_lists([e - s], [e], [list(range(1, nb + 1))],
                                                        bs, sliding_window=None)
            hidden = model(torch.tensor(ids[s:e]), torch.arange(s, e), kv,
                           model.attn_backend_cls.build_metadata(common))
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def test_tiny_gguf_model_native_float32_equals_dequantized(tmp_path):
    source = ModelSource("gguf", write_tiny_gguf(tmp_path / "tiny.gguf"), "tiny")
    dense = load_model(source, None, torch.float32)
    native = load_model(source, GGUFNativeConfig(torch.float32), torch.float32)
    layer = native.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj):
        assert isinstance(lin.quant_method, GGUFNativeLinearMethod)
    assert isinstance(native.model.embed_tokens.weight, NativeLMHeadWeight)
    ids = RNG.integers(0, 64, 20).tolist()
    ref = sequence_logits(dense, ids, 20)
    torch.testing.assert_close(sequence_logits(native, ids, 20), ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(sequence_logits(native, ids, 1), ref, rtol=0, atol=1e-4)
    bf16 = load_model(source, GGUFNativeConfig(torch.bfloat16), torch.bfloat16)
    assert (sequence_logits(bf16, ids, 1) - ref).abs().max() < 0.05 * ref.abs().max()


# ---------------------------------------------------------------- the real model
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
        "practical system for producing books. Before his invention, texts were copied by hand, "
        "a slow and expensive process that kept books rare. Within a few decades, printing "
        "shops had spread across Europe, and the price of books fell sharply. Scholars could "
        "compare identical copies of a text, which encouraged careful editing and the growth "
        "of science.")


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    lp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return math.exp(-lp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


@pytest.mark.model
def test_smollm2_native_logits_and_perplexity(llm_fp32, gguf_path):
    """Native Q4_1/Q8_0 (bf16 activations) vs the dequantized float32 model.

    Measured: max |diff| 0.72, mean 0.096 (max |logit| 35), the same as the dense
    bfloat16 path (0.75, 0.097); perplexity -0.2% (bfloat16 dense: +0.4%).
    """
    ref_model = llm_fp32.engine.runner.model
    ids = llm_fp32.get_tokenizer().encode(TEXT)
    native = load_model(ModelSource("gguf", gguf_path, "smollm2"),
                        get_quantization_config("gguf-native"), torch.bfloat16)
    assert isinstance(native.model.embed_tokens.weight, NativeLMHeadWeight)
    ref = sequence_logits(ref_model, ids, len(ids))
    prefill = sequence_logits(native, ids, len(ids))  # M = len(ids): one prefill step
    decode = sequence_logits(native, ids[:12], 1)  # M = 1: decode-like steps
    for got in (prefill, decode):
        diff = (got - ref[:got.shape[0]]).abs()
        assert diff.max() < 1.5 and diff.mean() < 0.15, (diff.max(), diff.mean())
    ppl_ref, ppl_native = perplexity(ref, ids), perplexity(prefill, ids)
    assert abs(ppl_native / ppl_ref - 1) < 0.005, (ppl_native, ppl_ref)


@pytest.mark.real_model
def test_qwen15_q4_k_m_native_logits_and_perplexity(qwen15_gguf):
    """Qwen2.5-Coder-1.5B Q4_K_M natively vs the same file dequantized to float32: every
    layer and the untied Q6_K LM head native; logits within the bf16 bound, perplexity
    within 0.5%. On an AVX512-VNNI CPU Q4_K and Q6_K run with int8 activations
    (gguf_matmul_x16, the default), elsewhere in the int4 kernel and gguf_matmul with
    bfloat16 activations.

    Measured (100 tokens of TEXT, Intel Xeon): int8 activations max |diff| 0.91, mean
    0.056 (max |logit| 26.5), perplexity -0.28%; bfloat16 activations
    (LLMSERVE_Q8K_DOT=0) 0.72, 0.025, -0.18%. Q8_K activations without the kernel's
    second pass for massive-activation rows (and llama.cpp): 13.1, 0.097, +4.1%, all of it
    at position 0.
    """
    if get_cpu_kernels() is None:
        pytest.skip("no C kernels: Q6_K layers stay dense")
    source = ModelSource("gguf", qwen15_gguf, "qwen15")
    native = load_model(source, get_quantization_config("gguf-native"), torch.bfloat16)
    kinds = {type(m.quant_method.packed).__name__ for m in native.modules()
             if isinstance(m, Linear)}
    # Q4_K in the int4 kernel, or with Q6_K in gguf_matmul_x16 (int8 activations, VNNI)
    assert kinds == ({"GGUFBlockWeight", "FusedNativeWeight"} if q8k_enabled(torch.bfloat16)
                     else {"Int4PackedWeight", "GGUFBlockWeight", "FusedNativeWeight"}), kinds
    assert isinstance(native.lm_head.quant_method.packed, GGUFBlockWeight)
    ids = load_tokenizer(source).encode(TEXT)
    prefill = sequence_logits(native, ids, len(ids))
    decode = sequence_logits(native, ids[:16], 1)
    del native
    ref = sequence_logits(load_model(source, None, torch.float32), ids, len(ids))
    for got in (prefill, decode):
        diff = (got - ref[:got.shape[0]]).abs()
        assert diff.max() < 1.5 and diff.mean() < 0.1, \
            (diff.max().item(), diff.mean().item(), ref.abs().max().item())
    ppl_ref, ppl_native = perplexity(ref, ids), perplexity(prefill, ids)
    print(f"qwen15 native vs fp32: max|diff| {(prefill - ref).abs().max():.3f} mean "
          f"{(prefill - ref).abs().mean():.4f} (max|logit| {ref.abs().max():.1f}); decode max "
          f"{(decode - ref[:16]).abs().max():.3f}; ppl {ppl_native:.4f} vs {ppl_ref:.4f}")
    assert abs(ppl_native / ppl_ref - 1) < 0.005, (ppl_native, ppl_ref)

"""``llmserve export``: GGUF files that llama.cpp (llama-cpp-python) runs, and ONNX decoders
with KV-cache inputs/outputs that ONNX Runtime runs, checked against our engine, the
``gguf`` package's reference dequantization and transformers."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (test extra)")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime (export extra)")

from llmserve.compress.gguf_export import export_gguf  # noqa: E402
from llmserve.compress.onnx_export import export_onnx  # noqa: E402
from llmserve.entrypoints.cli import main  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "List three colors: red,"]
NEW_TOKENS = 12


def _ours(llm, ids: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _llama_cpp(path: str, ids: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy in llama.cpp: argmax of its own logits, one token at a time."""
    m = llama_cpp.Llama(model_path=path, n_ctx=128, n_threads=1, logits_all=True,
                        verbose=False)
    out = []
    for prompt in ids:
        m.reset()
        m.eval(prompt)
        toks = []
        for _ in range(n):
            toks.append(int(np.argmax(m.scores[m.n_tokens - 1])))
            m.eval([toks[-1]])
        out.append(toks)
    return out


def _ort_greedy(model_dir: str, ids: list[list[int]], n: int = NEW_TOKENS):
    """Greedy in ONNX Runtime, feeding each step's ``present.*`` back as ``past_key_values.*``.
    Returns (tokens per prompt, the first step's logits per prompt)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(os.path.join(model_dir, "model.onnx"), so,
                                providers=["CPUExecutionProvider"])
    past_inputs = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    names = [o.name for o in sess.get_outputs()]
    tokens, first_logits = [], []
    for prompt in ids:
        past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
                for i in past_inputs}
        cur, pos, toks = list(prompt), 0, []
        for step in range(n):
            feed = {"input_ids": np.array([cur], np.int64),
                    "attention_mask": np.ones((1, pos + len(cur)), np.int64),
                    "position_ids": np.arange(pos, pos + len(cur), dtype=np.int64)[None], **past}
            res = dict(zip(names, sess.run(None, feed)))
            if step == 0:
                first_logits.append(res["logits"][0, -1])
            toks.append(int(res["logits"][0, -1].argmax()))
            past = {k: res[k.replace("past_key_values.", "present.")] for k in past}
            pos, cur = pos + len(cur), [toks[-1]]
        tokens.append(toks)
    return tokens, first_logits


@pytest.fixture(scope="module")
def prompt_ids(llm_fp32) -> list[list[int]]:
    tok = llm_fp32.get_tokenizer()
    return [tok.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.mark.model
def test_gguf_export_runs_in_llama_cpp_with_our_greedy_tokens(gguf_path, prompt_ids, tmp_path):
    """Default model -> f16 GGUF (dequantized Q4_1/Q8_0, requantized): llama.cpp and our
    engine on that file agree token for token; metadata copied from the source."""
    from llmserve import LLM

    out = export_gguf(gguf_path, str(tmp_path / "smol-f16.gguf"), "f16")
    src, dst = gguf.GGUFReader(gguf_path), gguf.GGUFReader(out)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template",
                "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id", "llama.block_count"):
        assert dst.fields[key].contents() == src.fields[key].contents(), key
    assert dst.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_F16
    types = {t.name: t.tensor_type for t in dst.tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    ours = _ours(LLM(model=out, dtype="float32", kv_cache_memory="32MiB"), prompt_ids)
    assert _llama_cpp(out, prompt_ids) == ours


@pytest.mark.model
def test_gguf_export_auto_copies_every_tensor_exactly(gguf_path, tmp_path, capsys):
    """``--type auto`` on a GGUF: the CLI writes the same tensors, byte for byte."""
    out = str(tmp_path / "copy.gguf")
    assert main(["export", gguf_path, "--format", "gguf", "--output", out]) == 0
    assert "wrote" in capsys.readouterr().out
    src = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    dst = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert src.keys() == dst.keys()
    for name, t in src.items():
        assert dst[name].tensor_type == t.tensor_type, name
        assert np.array_equal(np.asarray(dst[name].data), np.asarray(t.data)), name


def _tiny_llama_dir(path: str, tokenizer) -> tuple[str, torch.nn.Module]:
    """A random 2-layer Llama with the default model's real BPE tokenizer (vocab 49152)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path, model


@pytest.mark.model
def test_hf_and_gptq_checkpoints_to_gguf(llm_fp32, prompt_ids, tmp_path):
    """A dense HF directory -> f32 GGUF: llama.cpp's logits equal transformers' and its
    tokenizer (our BPE metadata) gives our ids; an RTN int4 GPTQ checkpoint -> q4_1 GGUF
    whose blocks dequantize (gguf's reference) to the checkpoint's own weights, and which
    ``llmserve quantize --format gguf`` writes in one step."""
    from llmserve.compress.pipeline import QuantizeOptions
    from llmserve.compress.quantize import quantize_checkpoint
    from llmserve.loader import iter_weights, load_model_config, resolve_model

    dense, model = _tiny_llama_dir(str(tmp_path / "dense"), llm_fp32.get_tokenizer())
    f32 = export_gguf(dense, str(tmp_path / "tiny-f32.gguf"), "f32")
    reader = gguf.GGUFReader(f32)
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    m = llama_cpp.Llama(model_path=f32, n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    for text, ids in zip(PROMPTS, prompt_ids):
        assert m.tokenize(text.encode(), add_bos=False, special=False) == ids
    m.reset()
    m.eval(prompt_ids[0])
    with torch.no_grad():
        ref = model(torch.tensor([prompt_ids[0]])).logits[0].numpy()
    # llama.cpp keeps its KV cache in f16 (type_k/type_v default): |logits| ~ 3, error ~ 5e-3
    np.testing.assert_allclose(np.asarray(m.scores[:len(prompt_ids[0])]), ref, atol=1.5e-2)

    ckpt = quantize_checkpoint(dense, QuantizeOptions("rtn", 4, group_size=32),
                               str(tmp_path / "gptq"), fmt="gptq", progress=False)
    q = export_gguf(ckpt, str(tmp_path / "tiny-q4.gguf"))  # auto: asymmetric int4 -> q4_1
    tensors = {t.name: t for t in gguf.GGUFReader(q).tensors}
    source = resolve_model(ckpt)
    want = dict(iter_weights(source, load_model_config(source)))
    t = tensors["blk.1.ffn_down.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
    got = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    w = want["model.layers.1.mlp.down_proj.weight"].numpy()
    np.testing.assert_allclose(got.reshape(w.shape), w, atol=2e-3 * np.abs(w).max())
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    # `llmserve quantize --format gguf` is that same path in one command (RTN: deterministic)
    direct = str(tmp_path / "direct.gguf")
    assert main(["quantize", dense, "--method", "rtn", "--group-size", "32", "--format",
                 "gguf", "--output", direct, "--no-progress"]) == 0
    for t in gguf.GGUFReader(direct).tensors:
        assert np.array_equal(np.asarray(t.data), np.asarray(tensors[t.name].data)), t.name


@pytest.mark.model
def test_onnx_export_greedy_with_kv_cache_equals_ours(gguf_path, llm_fp32, prompt_ids,
                                                      tmp_path):
    """Default model -> ONNX fp32: a greedy loop in ONNX Runtime over past_key_values.* /
    present.* gives our engine's tokens."""
    out = export_onnx(gguf_path, str(tmp_path / "onnx"))
    sess = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    inputs = [i.name for i in sess.get_inputs()]
    assert inputs[:5] == ["input_ids", "attention_mask", "position_ids",
                          "past_key_values.0.key", "past_key_values.0.value"]
    assert [o.name for o in sess.get_outputs()][-1] == "present.29.value"
    assert os.path.isfile(tmp_path / "onnx" / "tokenizer.json")
    tokens, _ = _ort_greedy(str(tmp_path / "onnx"), prompt_ids)
    assert tokens == _ours(llm_fp32, prompt_ids)


@pytest.mark.model
def test_onnx_int8_and_int4_weights(llm_fp32, prompt_ids, tmp_path):
    """Weight-only int4 (MatMulNBits) and int8 (MatMulInteger) through onnxruntime's
    quantizers: smaller files whose first-step logits stay correlated with fp32's."""
    import onnx

    dense, _ = _tiny_llama_dir(str(tmp_path / "dense"), llm_fp32.get_tokenizer())
    ids = prompt_ids[:2]
    ref = _ort_greedy(export_onnx(dense, str(tmp_path / "fp32")).rsplit("/", 1)[0], ids, 1)[1]
    size = os.path.getsize(tmp_path / "fp32" / "model.onnx")
    # random weights (no outliers to protect): int4 blocks of 32 keep corr ~0.97, int8 more
    for weights, ops, min_corr, max_size in (
            ("int4", {"MatMulNBits", "GatherBlockQuantized"}, 0.9, 0.25),
            ("int8", {"MatMulInteger"}, 0.98, 0.7)):  # int8: the embedding stays fp32
        path = export_onnx(dense, str(tmp_path / weights), weights=weights)
        assert ops <= {n.op_type for n in onnx.load(path).graph.node}
        assert os.path.getsize(path) < max_size * size
        got = _ort_greedy(str(tmp_path / weights), ids, 1)[1]
        for a, b in zip(got, ref):
            corr = np.corrcoef(a, b)[0, 1]
            assert corr > min_corr, (weights, corr)


def test_export_bad_input_is_a_clear_error(gguf_path, tmp_path, capsys):
    out = str(tmp_path / "x.gguf")
    assert main(["export", gguf_path, "--format", "tflite", "--output", out]) == 2
    assert "--format must be one of ['gguf', 'onnx']" in capsys.readouterr().err
    assert main(["export", gguf_path, "--format", "gguf", "--type", "q4_k_m",
                 "--output", out]) == 2
    err = capsys.readouterr().err
    assert "--type must be one of" in err and "llama-quantize" in err
    assert main(["export", gguf_path, "--format", "onnx", "--weights", "int3",
                 "--output", str(tmp_path / "o")]) == 2
    assert "--weights must be one of ['fp32', 'int8', 'int4']" in capsys.readouterr().err
    assert main(["export", gguf_path, "--format", "gguf", "--output", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["quantize", gguf_path, "--method", "smoothquant", "--format", "gguf",
                 "--output", out]) == 2
    assert "cannot be written as --format gguf" in capsys.readouterr().err
    assert not os.path.exists(out)

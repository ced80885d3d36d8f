"""``llmserve quantize`` / ``llmserve eval`` end to end on a tiny random Llama.

The model is built in transformers and saved as safetensors (``tests/quant_checkpoints``).
Oracles: transformers in float32 (perplexity on the same weights and tokens; greedy
tokens of the dequantized weights), an unpacker written here from the GPTQ / AWQ
layouts (no llmserve code), and the ``compressed-tensors`` package's own config
schema and decompressors for our compressed-tensors checkpoints.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from llmserve import LLM, SamplingParams
from llmserve.compress.evaluate import evaluate, load_model, window_logits
from llmserve.compress.pipeline import QuantizeOptions
from llmserve.compress.quantize import quantize_checkpoint
from llmserve.entrypoints.cli import main
from tests.quant_checkpoints import hf_greedy, make_hf_llama, save_tokenizer

PROMPTS = [[5, 17, 99, 3, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [64]]
NEW_TOKENS = 10
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: OpenMP wake-ups dominate on 2 loaded cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(dense HF dir, the transformers model, a calibration file, an eval text file)."""
    root = tmp_path_factory.mktemp("compress")
    model = make_hf_llama()
    path = str(root / "dense")
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, model.config.vocab_size)
    rng = np.random.default_rng(0)
    calib = root / "calib.txt"
    calib.write_text(" ".join(f"t{int(t)}" for t in rng.integers(0, 127, 8 * 64)))
    text = root / "eval.txt"
    text.write_text(" ".join(f"t{int(t)}" for t in rng.integers(0, 127, 3 * 48 + 10)))
    return path, model, str(calib), str(text)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _words(path: str, lengths: int) -> list[list[int]]:
    with open(path) as f:
        ids = [int(w[1:]) for w in f.read().split()]
    return [ids[i:i + lengths] for i in range(0, len(ids) - lengths + 1, lengths)]


def test_eval_perplexity_equals_transformers(tiny):
    path, model, _, text = tiny
    res = evaluate(path, reference=path, text=_read(text), seq_len=48)
    nll = count = 0
    with torch.no_grad():  # the oracle: transformers fp32, same weights, same windows
        for ids in _words(text, 48):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
            nll -= float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
            count += len(ids) - 1
    assert res.num_windows == 3 and res.num_tokens == count
    assert math.isclose(res.perplexity, math.exp(nll / count), rel_tol=1e-4)
    assert res.kl_mean < 1e-9 and res.top1_agreement == 1.0  # a model against itself


def test_eval_cli(tiny, capsys):
    path, _, _, text = tiny
    assert main(["eval", path, "--text", text, "--seq-len", "48", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_windows"] == 3 and out["kl_mean"] is None
    assert out["perplexity"] == pytest.approx(evaluate(path, text=_read(text),
                                                       seq_len=48).perplexity, rel=1e-6)
    assert main(["eval", path, "--text", text + ".missing"]) == 2
    assert "--text" in capsys.readouterr().err
    assert main(["eval", path, "--dataset", "fr"]) == 2
    assert "--dataset must be one of" in capsys.readouterr().err


def _unpack(words: np.ndarray, bits: int, dim: int) -> np.ndarray:
    """int32 words -> fields along ``dim`` (field i of word j = element j*32/b + i)."""
    w = words.view(np.uint32)
    per = 32 // bits
    fields = [(w >> np.uint32(bits * i)) & np.uint32((1 << bits) - 1) for i in range(per)]
    stacked = np.stack(fields, axis=dim + 1)  # [.., per] after dim
    shape = list(w.shape)
    shape[dim] *= per
    return stacked.reshape(shape).astype(np.int64)


def _dequant_gptq(t: dict[str, torch.Tensor], m: str, bits: int) -> torch.Tensor:
    q = _unpack(t[f"{m}.qweight"].numpy(), bits, 0)  # [K, N]
    z = (_unpack(t[f"{m}.qzeros"].numpy(), bits, 1) + 1) & ((1 << bits) - 1)  # v1: z - 1
    s = t[f"{m}.scales"].float().numpy()  # [G, N]
    g = t[f"{m}.g_idx"].numpy().astype(np.int64)
    return torch.from_numpy(((q - z[g]) * s[g]).T.astype(np.float32))


def _dequant_awq(t: dict[str, torch.Tensor], m: str) -> torch.Tensor:
    def cols(words):  # [R, C/8] -> [R, C] with the AWQ nibble order
        f = _unpack(words, 4, 1).reshape(words.shape[0], -1, 8)
        out = np.empty_like(f)
        out[:, :, AWQ_ORDER] = f
        return out.reshape(words.shape[0], -1)

    q, z = cols(t[f"{m}.qweight"].numpy()), cols(t[f"{m}.qzeros"].numpy())
    s = t[f"{m}.scales"].float().numpy()
    group = q.shape[0] // s.shape[0]
    g = np.arange(q.shape[0]) // group
    return torch.from_numpy(((q - z[g]) * s[g]).T.astype(np.float32))


def _dequant_ct(t: dict[str, torch.Tensor], m: str, qc: dict) -> torch.Tensor:
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
    state = {k.rsplit(".", 1)[1]: v for k, v in t.items() if k.rsplit(".", 1)[0] == m}
    state["weight_scale"] = state["weight_scale"].float()
    comp = (PackedQuantizationCompressor if "weight_packed" in state
            else IntQuantizationCompressor)
    return comp.decompress(state, scheme)["weight"].float()


def _reference(out: str, fmt: str, **extra) -> torch.nn.Module:
    """transformers fp32 on the checkpoint: dense tensors as written (biases too),
    quantized modules' weights dequantized by the independent unpackers above."""
    qc = json.loads(_read(os.path.join(out, "config.json")))["quantization_config"]
    t = load_file(os.path.join(out, "model.safetensors"))
    ref = make_hf_llama(**extra)
    state = ref.state_dict()
    modules = {k.rsplit(".", 1)[0] for k in t if not k.endswith((".weight", ".bias")) or
               k.endswith("_packed") or t[k].dtype == torch.int8}
    modules = {m for m in modules if m in dict(ref.named_modules())}
    for name in state:
        m = name.rsplit(".", 1)[0]
        if m in modules and name.endswith(".weight"):
            if fmt == "gptq":
                state[name] = _dequant_gptq(t, m, qc["bits"])
            elif fmt == "awq":
                state[name] = _dequant_awq(t, m)
            else:
                state[name] = _dequant_ct(t, m, qc)
        elif name in t:
            state[name] = t[name]
    assert len(modules) == 2 * 7  # every decoder linear is quantized, lm_head is not
    ref.load_state_dict(state)
    return ref.eval()




def _llm_greedy(path: str) -> list[list[int]]:
    llm = LLM(model=path, dtype="float32", kv_cache_memory="8MiB", max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("method,fmt,act_order,group,bits", [
    ("gptq", "gptq", True, 32, 4),
    ("gptq", "compressed-tensors", False, 64, 4),
    ("awq", "awq", False, 32, 4),
    ("gptq", "gptq", False, 64, 8),
    ("rtn", "compressed-tensors", False, -1, 8),
])
def test_quantized_checkpoint_loads_with_reference_greedy(tiny, tmp_path, method, fmt,
                                                          act_order, group, bits):
    pytest.importorskip("compressed_tensors")
    path, _, calib, text = tiny
    out = quantize_checkpoint(path, QuantizeOptions(method, bits, group, act_order=act_order),
                              str(tmp_path / "q"), fmt=fmt, calib=calib, num_samples=8,
                              seq_len=64, progress=False)
    qc = json.loads(_read(os.path.join(out, "config.json")))["quantization_config"]
    if fmt == "compressed-tensors":  # the package's own schema accepts our config
        from compressed_tensors.quantization import QuantizationConfig

        parsed = QuantizationConfig.model_validate(qc)
        assert parsed.format == "pack-quantized"
        weights = parsed.config_groups["group_0"].weights
        assert weights.num_bits == bits
        assert weights.group_size == (None if group == -1 else group)
    ref = _reference(out, fmt)
    assert _llm_greedy(out) == hf_greedy(ref, PROMPTS, NEW_TOKENS)
    if fmt == "gptq" and bits == 4:  # eval: dequantized-at-load == the native int4 kernel
        dense = evaluate(out, reference=path, text=_read(text), seq_len=48)
        native = evaluate(out, reference=path, text=_read(text), seq_len=48,
                          quantization="native")
        assert math.isclose(dense.perplexity, native.perplexity, rel_tol=1e-3)
        assert math.isclose(dense.kl_mean, native.kl_mean, rel_tol=1e-2)
        assert 0 < dense.kl_mean <= dense.kl_max and 0.5 < dense.top1_agreement <= 1


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_quantized_linears_keep_their_biases(tiny, tmp_path, fmt):
    """q/k/v/o biases (Llama ``attention_bias``; Qwen2's q/k/v) are written beside the
    packed weights (float32) and loaded, dense matrices in bf16: greedy tokens equal
    transformers with those tensors."""
    if fmt == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    _, _, calib, _ = tiny
    model = make_hf_llama(attention_bias=True)
    path = str(tmp_path / "dense")
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, model.config.vocab_size)
    out = quantize_checkpoint(path, QuantizeOptions("rtn", 4, 32), str(tmp_path / "q"),
                              fmt=fmt, calib=calib, num_samples=8, seq_len=64, progress=False)
    stored = load_file(os.path.join(out, "model.safetensors"))
    for name, p in model.named_parameters():
        if name.endswith(".bias") or "norm" in name:  # 1-D tensors stay float32
            assert torch.equal(stored[name], p.detach().float()), name
    # dense matrices (embeddings; lm_head when untied) are bf16, as the engine serves them
    embed = stored["model.embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16
    assert torch.equal(embed, model.model.embed_tokens.weight.detach().bfloat16())
    ref = _reference(out, fmt, attention_bias=True)
    assert _llm_greedy(out) == hf_greedy(ref, PROMPTS, NEW_TOKENS)


def test_smoothquant_w8a8_logits_close_to_fp32(tiny, tmp_path):
    pytest.importorskip("compressed_tensors")
    path, model, calib, text = tiny
    out = quantize_checkpoint(path, QuantizeOptions("smoothquant", 8, -1), str(tmp_path / "q"),
                              calib=calib, num_samples=8, seq_len=64, progress=False)
    ref = _reference(out, "compressed-tensors")  # compressed-tensors decompressor, fp32
    loaded = load_model(out)
    assert loaded.weights == "compressed-tensors"
    ids = _words(text, 48)[0]
    ours = window_logits(loaded.model, ids)
    with torch.no_grad():
        fp32 = model(torch.tensor([ids])).logits[0]
        deq = ref(torch.tensor([ids])).logits[0]
    def rel(a, b):  # relative RMS error
        return float((a - b).norm() / b.norm())

    # stated tolerance, on this deliberately sensitive random model (weights 0.2 N(0, 1):
    # int8 weights alone move its logits by ~4% RMS; measured: 4.3%, 7.7%, 6.1%, 90%)
    assert rel(deq, fp32) < 0.06  # int8 per-channel weights (after smoothing)
    assert rel(ours, fp32) < 0.10  # + dynamic per-token int8 activations, in the engine
    assert rel(ours, deq) < 0.08
    assert float((ours.argmax(-1) == fp32.argmax(-1)).float().mean()) >= 0.85


def test_quantize_bad_input_is_a_clear_error(tiny, tmp_path, capsys):
    path, _, calib, _ = tiny
    out = str(tmp_path / "q")
    cases = [
        (["--method", "awq", "--bits", "8"], "--bits 8 is not supported by --method awq"),
        (["--method", "smoothquant", "--bits", "4"], "--bits 4 is not supported"),
        (["--method", "smoothquant", "--format", "gptq"], "cannot be written as --format gptq"),
        (["--method", "gptq", "--act-order", "--format", "awq"], "no g_idx"),
        (["--method", "gptq", "--calib", calib, "--num-samples", "64", "--seq-len", "64"],
         "too few for 64 samples"),
    ]
    for extra, message in cases:
        rc = main(["quantize", path, "--output", out, "--group-size", "32", "--no-progress",
                   *extra])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, (extra, err)
    assert not os.path.exists(os.path.join(out, "config.json"))


@pytest.mark.model
def test_eval_default_model_perplexity_equals_transformers(gguf_path, hf_model):
    """The embedded GGUF in float32: our perplexity == transformers' on its dequantized
    weights, on the same built-in windows (each starting with BOS)."""
    from llmserve.compress.texts import builtin_text, token_windows
    from llmserve.loader import resolve_model
    from llmserve.tokenizer import load_tokenizer

    res = evaluate(gguf_path, dataset="code", seq_len=64, max_windows=2)
    tok = load_tokenizer(resolve_model(gguf_path))
    ids = tok.encode(builtin_text("eval", "code"), add_special_tokens=False)
    windows = token_windows(ids, 64, bos_token_id=tok.bos_token_id)[:2]
    nll = count = 0
    with torch.no_grad():
        for w in windows:
            logp = torch.log_softmax(hf_model(torch.tensor([w])).logits[0, :-1].double(), -1)
            nll -= float(logp.gather(1, torch.tensor(w[1:])[:, None]).sum())
            count += len(w) - 1
    assert res.num_tokens == count == 126
    assert math.isclose(res.perplexity, math.exp(nll / count), rel_tol=1e-3)

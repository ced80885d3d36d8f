"""``llmserve export --format gguf``: write a model as a GGUF file that llama.cpp loads.

::

    export_gguf("model_dir_or.gguf", "out.gguf", gguf_type="q8_0")

Sources and what happens to their weights:

=======================  ===================================================================
source                   weights
=======================  ===================================================================
GGUF file                ``--type auto``: every tensor copied byte for byte (exact); another
                         type: dequantized (gguf's reference formulas) and requantized.
                         Metadata (hparams, tokenizer, chat template) copied.
HF directory, dense      float32 -> ``--type`` (``auto`` = f16); Q/K rows permuted for
                         ``llama`` as ``convert_hf_to_gguf.py`` does (``LlamaModel.permute``)
GPTQ / AWQ /             dequantized by the checkpoint's own formula, then requantized in
compressed-tensors       32-weight blocks (``auto``: 8 bits -> q8_0; 4 bits -> q4_0 if
                         symmetric, else q4_1; embeddings / lm_head q8_0). An int4 group of
                         32 with codes spanning 0..15 maps exactly onto q4_1's d, m.
W8A8 (SmoothQuant)       ValueError: GGUF has no int8-activation format
=======================  ===================================================================

Types: :data:`GGUF_TYPES` (the ones the ``gguf`` package quantizes; K-quants: export f16
and run llama.cpp's ``llama-quantize``). 1-D tensors (norms, biases) stay F32, and a
matrix whose rows are not whole blocks falls back to F16, as in llama.cpp.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType as FT
from gguf.quants import dequantize, quantize

from llmserve.compress.gguf_meta import (
    add_hf_tokenizer,
    add_hparams,
    copy_metadata,
    gguf_architecture,
)

logger = logging.getLogger(__name__)

GGUF_TYPES = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q5_1": T.Q5_1,
              "q5_0": T.Q5_0, "q4_1": T.Q4_1, "q4_0": T.Q4_0}
EXPORT_TYPES = ("auto", *GGUF_TYPES)
FILE_TYPES = {T.F32: FT.ALL_F32, T.F16: FT.MOSTLY_F16, T.BF16: FT.MOSTLY_BF16,
              T.Q8_0: FT.MOSTLY_Q8_0, T.Q5_1: FT.MOSTLY_Q5_1, T.Q5_0: FT.MOSTLY_Q5_0,
              T.Q4_1: FT.MOSTLY_Q4_1, T.Q4_0: FT.MOSTLY_Q4_0}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def check_gguf_type(gguf_type: str) -> None:
    """Raises ValueError for a ``--type`` outside :data:`EXPORT_TYPES`."""
    if gguf_type not in EXPORT_TYPES:
        hint = (" (K-quants: export f16, then run llama.cpp's llama-quantize)"
                if gguf_type.lower().startswith(("q2_k", "q3_k", "q4_k", "q5_k", "q6_k"))
                else "")
        raise ValueError(f"--type must be one of {list(EXPORT_TYPES)}, got {gguf_type!r}{hint}")


def gguf_tensor_name(hf_name: str) -> str:
    """Hugging Face tensor name -> llama.cpp's (``model.layers.3.mlp.up_proj.weight`` ->
    ``blk.3.ffn_up.weight``).

    Raises:
        ValueError: a tensor with no GGUF name in the dense architectures.
    """
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    parts = hf_name.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        module, suffix = ".".join(parts[3:-1]), parts[-1]
        if module in _LAYER and suffix in ("weight", "bias"):
            return f"blk.{parts[2]}.{_LAYER[module]}.{suffix}"
    raise ValueError(f"tensor {hf_name!r} has no GGUF name (dense Llama/Qwen2/Qwen3 only)")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp's interleaved pairs (``LlamaModel.permute``);
    ``w`` ``[n_head * head_dim, ...]``."""
    return np.ascontiguousarray(
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
        .reshape(w.shape))


def encode_tensor(w: np.ndarray, qtype: T) -> tuple[np.ndarray, T]:
    """``w`` float32 (numpy shape = GGUF ``ne`` reversed) -> ``(data, type)`` for
    ``GGUFWriter.add_tensor(raw_dtype=type)``: 1-D stays F32, rows that are not whole
    blocks fall back to F16."""
    if w.ndim == 1 or qtype == T.F32:
        return np.ascontiguousarray(w, dtype=np.float32), T.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if w.shape[-1] % block:
        logger.warning("row of %d not a multiple of %s's %d-block: F16", w.shape[-1],
                       qtype.name, block)
        qtype = T.F16
    if qtype == T.F16:
        return w.astype(np.float16), T.F16
    return quantize(np.ascontiguousarray(w, dtype=np.float32), qtype), qtype


def _checkpoint_bits(model_dir: str) -> tuple[int, bool] | None:
    """``(bits, symmetric)`` of a weight-only quantized checkpoint, None if dense.

    Raises:
        ValueError: a W8A8 (int8 activation) checkpoint.
    """
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        qc = json.load(f).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "gptq":
        return int(qc.get("bits", 4)), bool(qc.get("sym", True))
    if method == "awq":
        return int(qc.get("bits", 4)), not qc.get("zero_point", True)
    scheme = next(iter((qc.get("config_groups") or {}).values()), {})
    if scheme.get("input_activations"):
        raise ValueError(f"{model_dir!r} is a W8A8 checkpoint (int8 activations, e.g. "
                         "SmoothQuant); GGUF has no such format: export the dense model, "
                         "or quantize weight-only (--method rtn|gptq|awq)")
    w = scheme.get("weights") or {}
    return int(w.get("num_bits", 4)), bool(w.get("symmetric", True))


def _hf_types(model_dir: str, gguf_type: str) -> tuple[T, T]:
    """``(type of the layers' linears, type of embeddings / lm_head)``."""
    bits = _checkpoint_bits(model_dir)
    if gguf_type != "auto":
        return GGUF_TYPES[gguf_type], GGUF_TYPES[gguf_type]
    if bits is None:
        return T.F16, T.F16
    if bits[0] == 8:
        return T.Q8_0, T.Q8_0
    return (T.Q4_0 if bits[1] else T.Q4_1), T.Q8_0


def _hf_tensors(source, config, arch: str, gguf_type: str,
                ) -> Iterator[tuple[str, np.ndarray, T]]:
    from llmserve.loader import iter_weights

    layer_type, outer_type = _hf_types(source.path, gguf_type)
    for hf_name, t in iter_weights(source, config):
        name = gguf_tensor_name(hf_name)
        if name == "output.weight" and config.tie_word_embeddings:
            continue
        w = t.float().numpy()
        if arch == "llama" and ".attn_q." in name:
            w = permute_qk(w, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            w = permute_qk(w, config.num_key_value_heads)
        qtype = layer_type if name.startswith("blk.") else outer_type
        data, qtype = encode_tensor(w, qtype)
        yield name, data, qtype


def _gguf_tensors(reader: gguf.GGUFReader, gguf_type: str,
                  ) -> Iterator[tuple[str, np.ndarray, T]]:
    for t in reader.tensors:
        if gguf_type == "auto" or t.tensor_type == GGUF_TYPES[gguf_type] \
                or len(t.shape) == 1:
            yield t.name, np.asarray(t.data), t.tensor_type
            continue
        shape = [int(d) for d in reversed(t.shape)]
        w = np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
        data, qtype = encode_tensor(w.reshape(shape), GGUF_TYPES[gguf_type])
        yield t.name, data, qtype


def export_gguf(model: str, output: str, gguf_type: str = "auto") -> str:
    """Write ``model`` (model name, GGUF file or Hugging Face directory, dense or weight-only
    quantized) to the GGUF file ``output`` with weights of ``gguf_type``; returns ``output``.

    Raises:
        ValueError: an unknown ``gguf_type``, an unsupported architecture or checkpoint
            (W8A8, no tokenizer.json), ``output`` a directory, or a bad model.
    """
    from llmserve.loader import load_model_config, resolve_model

    check_gguf_type(gguf_type)
    if os.path.isdir(output):
        raise ValueError(f"--output {output!r} is a directory; pass a .gguf file path")
    source = resolve_model(model)
    config = load_model_config(source)
    arch = gguf_architecture(config)
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    writer = gguf.GGUFWriter(output, arch)
    counts: dict[T, int] = {}
    if source.kind == "gguf":
        reader = gguf.GGUFReader(source.path)
        copy_metadata(writer, reader)
        tensors = _gguf_tensors(reader, gguf_type)
    else:
        _checkpoint_bits(source.path)  # W8A8 fails before any work
        writer.add_name(os.path.basename(os.path.normpath(source.path)))
        add_hparams(writer, config, arch)
        add_hf_tokenizer(writer, source.path, config)
        tensors = _hf_tensors(source, config, arch, gguf_type)
    for name, data, qtype in tensors:
        writer.add_tensor(name, data, raw_dtype=qtype)
        if data.ndim > 1:
            counts[qtype] = counts.get(qtype, 0) + 1
    main = max(counts, key=counts.get) if counts else T.F32
    writer.add_file_type(FILE_TYPES.get(main, FT.GUESSED))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return output

"""GGUF reader: model config from metadata, weights dequantized to float32.

The header (metadata, tensor table) comes from :mod:`llmserve.loader.gguf_header`.
``ne[0]`` is the innermost (contiguous) dimension, so the numpy shape is
``ne`` reversed: a linear layer ``[ne0=in_features, ne1=out_features]``
becomes the Hugging Face ``[out_features, in_features]``.

Every tensor type the ``gguf`` package
can dequantize loads (:mod:`llmserve.loader.gguf_types`, llama.cpp's reference formulas).
With a quantization config, tensors of the types it runs natively come out as raw blocks
(:class:`~llmserve.layers.quantization.gguf_blocks.GGUFQuantizedTensor`) instead.

Before any weight is read, the tensor table is checked against the file and the model
config (:mod:`llmserve.loader.gguf_checks`): a truncated file, overlapping or misaligned tensor
data, a row that is not a whole number of blocks, or a tensor whose shape disagrees with
the metadata is a ValueError naming the file and the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from llmserve.config import ModelConfig
from llmserve.layers.quantization.base import QuantizationConfig
from llmserve.layers.quantization.gguf_blocks import GGUFQuantizedTensor
from llmserve.loader.gguf_checks import check_gguf_shapes, check_tensor_data
from llmserve.loader.gguf_header import (  # noqa: F401 - re-exported
    MAX_METADATA_ARRAY_LEN,
    GGUFHeader,
    GGUFTensorInfo,
    read_gguf_array,
    read_gguf_header,
    read_gguf_strings,
)
from llmserve.loader.gguf_types import (
    LOADABLE_GGUF_TYPES,
    dequantize,
    ggml_type_name,
)
from llmserve.loader.gguf_vocab import chat_template_end_of_turn

SUPPORTED_GGUF_TYPES: frozenset[GGMLQuantizationType] = LOADABLE_GGUF_TYPES
SUPPORTED_GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",  # llama.cpp also stores Mistral as "llama"
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",  # + attn_q_norm / attn_k_norm per layer
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # Qwen3 QK-norm
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_SKIPPED_TENSORS = {"rope_freqs.weight"}  # folded into ModelConfig.rope_scaling


def _architecture(meta: dict[str, Any], path: str) -> str:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} in {path!r} is not supported; supported: "
                         f"{', '.join(sorted(SUPPORTED_GGUF_ARCHITECTURES))}")
    if meta.get(f"{arch}.expert_count", 0):
        raise ValueError(f"{path!r} is a mixture-of-experts GGUF ({arch}.expert_count="
                         f"{meta[f'{arch}.expert_count']}); only dense models are supported")
    return arch


def _rope_scaling(meta: dict[str, Any], arch: str, header: GGUFHeader) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``{arch}.rope.scaling.*`` or a Llama-3 ``rope_freqs`` tensor."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind in ("linear", "yarn") and factor:
        out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if orig:
            out["original_max_position_embeddings"] = int(orig)
        return out
    freqs = next((t for t in header.tensors if t.name == "rope_freqs.weight"), None)
    return None if freqs is None else _llama3_rope_scaling(header, freqs, meta, arch)


def _llama3_rope_scaling(header: GGUFHeader, info: GGUFTensorInfo, meta: dict[str, Any],
                         arch: str) -> dict[str, Any]:
    """Recover HF ``rope_type: llama3`` parameters from llama.cpp's per-frequency divisors.

    llama.cpp (``convert_hf_to_gguf.py``, LlamaModel.generate_extra_tensors) stores
    ``rope_freqs[i]`` = the divisor applied to ``inv_freq[i]``. We try the published
    Llama 3.1/3.2 settings (low_freq_factor 1, high_freq_factor 4, original context 8192)
    with ``factor = max(rope_freqs)`` and accept them when they reproduce the tensor.

    Raises:
        ValueError: the divisors do not match any known llama3 setting.
    """
    stored = _read_tensor(np.memmap(header.path, dtype=np.uint8, mode="r"), info).astype(np.float64)
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    dim = 2 * stored.size
    factor = float(stored.max())
    cfg = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv_freq = theta ** -(np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / inv_freq
    old = cfg["original_max_position_embeddings"]
    smooth = (old / wavelen - 1.0) / (4.0 - 1.0)
    expected = np.where(wavelen < old / 4.0, 1.0,
                        np.where(wavelen > old, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    if not np.allclose(expected, stored, rtol=1e-3):
        raise ValueError(f"{header.path!r}: rope_freqs.weight does not match a known llama3 "
                         "rope scaling; this GGUF's rotary scaling is not supported")
    return cfg


def read_gguf_config(path: str) -> tuple[ModelConfig, dict[str, Any]]:
    """Read a GGUF file's architecture into a :class:`ModelConfig` (HF field names).

    Mapping (``{arch}`` = ``general.architecture``): ``block_count`` ->
    num_hidden_layers, ``embedding_length`` -> hidden_size, ``feed_forward_length`` ->
    intermediate_size, ``attention.head_count[_kv]`` -> num_[key_value_]heads,
    ``attention.key_length`` or ``rope.dimension_count`` -> head_dim, ``rope.freq_base``
    -> rope_theta, ``attention.layer_norm_rms_epsilon`` -> rms_norm_eps,
    ``context_length`` -> max_position_embeddings, ``vocab_size`` (else the length of
    ``tokenizer.ggml.tokens``), tied embeddings = no ``output.weight`` tensor,
    attention_bias = a ``blk.0.attn_q.bias`` tensor exists, eos_token_ids = the
    ``tokenizer.ggml.{eos,eot,eom}_token_id`` present plus the token that ends an
    assistant turn in ``tokenizer.chat_template`` (e.g. ``<|im_end|>``, ``<|eot_id|>``;
    :func:`~llmserve.loader.gguf_vocab.chat_template_end_of_turn`).

    Returns:
        ``(config, metadata)``; ``metadata`` maps every key to its value except arrays
        longer than :data:`MAX_METADATA_ARRAY_LEN` (tokenizer tokens, scores, merges).

    Raises:
        ValueError: unsupported architecture, MoE model, a corrupt/unsupported file, or
            tensors that disagree with the file size or the metadata (see
            :func:`check_tensor_data` and :func:`check_gguf_shapes`).
    """
    header = read_gguf_header(path)
    meta = header.metadata
    arch = _architecture(meta, path)
    check_tensor_data(header)
    names = {t.name for t in header.tensors}

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    vocab_size = get("vocab_size") or header.array_lengths.get("tokenizer.ggml.tokens", 0)
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]
    end_of_turn = chat_template_end_of_turn(header)
    if end_of_turn is not None:
        eos.append(end_of_turn)
    num_heads = get("attention.head_count")
    try:
        config = ModelConfig(
            architecture=SUPPORTED_GGUF_ARCHITECTURES[arch], model_type=arch,
            vocab_size=int(vocab_size), hidden_size=get("embedding_length"),
            intermediate_size=get("feed_forward_length"), num_hidden_layers=get("block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=get("attention.head_count_kv") or num_heads,
            head_dim=get("attention.key_length") or get("rope.dimension_count") or 0,
            rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=get("rope.freq_base", 10000.0),
            rope_scaling=_rope_scaling(meta, arch, header),
            max_position_embeddings=get("context_length", 2048),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            sliding_window=get("attention.sliding_window"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )
    except TypeError as e:  # a required key was missing (None)
        raise ValueError(f"{path!r}: GGUF metadata is missing a required {arch}.* key ({e})") from None
    except ValueError as e:  # a value out of range (ModelConfig.__post_init__)
        raise ValueError(f"{path!r}: {e}") from None
    check_gguf_shapes(header, config)
    return config, meta


def _raw_bytes(mm: np.memmap, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes as uint8 ``[*shape[:-1], bytes per row]`` (a view of the file)."""
    byte_shape = quant_shape_to_byte_shape(info.shape, GGMLQuantizationType(info.ggml_type))
    nbytes = int(np.prod(byte_shape))
    return np.asarray(mm[info.offset:info.offset + nbytes]).reshape(byte_shape)


def _read_tensor(mm: np.memmap, info: GGUFTensorInfo) -> np.ndarray:
    """Dequantize one tensor to a float32 array of ``info.shape`` that owns its memory."""
    out = dequantize(_raw_bytes(mm, info), GGMLQuantizationType(info.ggml_type))
    if not out.flags.writeable or out.dtype != np.float32:  # F32 is a view of the file
        out = np.array(out, dtype=np.float32)
    return out.reshape(info.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py, LlamaModel.permute).

    Forward: ``w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)`` turns the
    HF rotate-half layout into interleaved pairs; swapping back inverts it.
    Shape ``[n_head * head_dim, ...]`` (weight) or ``[n_head * head_dim]`` (bias).
    """
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def hf_tensor_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> Hugging Face name; ``None`` for tensors that are skipped.

    Raises:
        ValueError: an unknown tensor name (e.g. MoE experts, vision towers).
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _SKIPPED_TENSORS:
        return None
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES \
            and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in the "
                     "supported architectures")


def iter_gguf_weights(path: str, config: ModelConfig,
                      quantization: QuantizationConfig | None = None,
                      ) -> Iterator[tuple[str, torch.Tensor | GGUFQuantizedTensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every weight of a GGUF file, in file order.

    Names: ``model.embed_tokens.weight`` [vocab, hidden], ``model.layers.{i}.
    input_layernorm.weight`` [hidden], ``...self_attn.{q,k,v,o}_proj.weight``
    [out, in] (+ ``.bias`` for q/k/v), ``...post_attention_layernorm.weight``,
    ``...mlp.{gate,up,down}_proj.weight``, ``model.norm.weight``, and ``lm_head.weight``
    only when the file has ``output.weight`` (untied). For ``llama`` files, Q/K rows are
    un-permuted back to HF order (q by ``num_attention_heads``, k by
    ``num_key_value_heads``); ``qwen2`` files are stored unpermuted.

    With ``quantization``, a 2-D tensor whose type is in its ``gguf_raw_types`` comes
    out as a :class:`GGUFQuantizedTensor` (raw blocks ``[rows, bytes per row]``; the
    Q/K un-permutation moves whole rows of blocks, which is exact) instead.

    Raises:
        ValueError: a tensor of a type outside :data:`SUPPORTED_GGUF_TYPES`, an unknown
            tensor name, or tensor sizes that disagree with the file or ``config``. All
            are checked for every tensor before the first is yielded.
    """
    header = read_gguf_header(path)
    arch = _architecture(header.metadata, path)
    check_tensor_data(header)  # every type loadable, sizes agree with the file
    for info in header.tensors:
        hf_tensor_name(info.name)
    check_gguf_shapes(header, config)
    raw_types = quantization.gguf_raw_types if quantization is not None else frozenset()
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        name = hf_tensor_name(info.name)
        if name is None:
            continue
        type_name = GGMLQuantizationType(info.ggml_type).name
        raw = len(info.shape) == 2 and type_name in raw_types
        w = _raw_bytes(mm, info) if raw else _read_tensor(mm, info)
        if arch == "llama" and ".self_attn.q_proj." in name:
            w = _unpermute(w, config.num_attention_heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            w = _unpermute(w, config.num_key_value_heads)
        if raw:
            yield name, GGUFQuantizedTensor(type_name, info.shape, w, quantization)
        else:
            yield name, torch.from_numpy(w)


def gguf_tensor_types(path: str) -> dict[str, str]:
    """``{gguf tensor name: ggml type name}`` (e.g. ``"Q4_1"``), for reporting."""
    return {t.name: ggml_type_name(t.ggml_type) for t in read_gguf_header(path).tensors}


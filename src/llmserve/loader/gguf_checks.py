"""Checks of a GGUF tensor table against the file and the model config, before any
weight is read, so a bad file fails with a message instead of deep inside numpy or a
kernel.

What llama.cpp's ``gguf.cpp`` (``gguf_init_from_file_impl``) checks, plus shapes::

    type        known to the gguf package and dequantizable (gguf_types.check_loadable)
    row size    ne[0] a whole number of blocks of the type
    offset      a multiple of general.alignment
    extent      data_start + offset + nbytes <= file size     (else: truncated)
    overlap     no two tensors share bytes                    (sizes disagree with the header)
    shape       every weight has the HF shape that the metadata implies (check_gguf_shapes)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmserve.config import ModelConfig
from llmserve.loader.gguf_types import ggml_type_name, tensor_nbytes

if TYPE_CHECKING:
    from llmserve.loader.gguf_header import GGUFHeader


def check_tensor_data(header: GGUFHeader) -> None:
    """Check that every tensor's data lies inside the file, aligned and without overlap.

    Raises:
        ValueError: naming the file and the tensor: an unsupported type, a row that is
            not a whole number of blocks, a misaligned offset, data past the end of the
            file (truncated download), or two tensors whose data overlap (tensor sizes
            that disagree with the header).
    """
    path = header.path
    spans = []
    for info in header.tensors:
        nbytes = tensor_nbytes(path, info.name, info.shape, info.ggml_type)
        if info.offset % header.alignment:  # the data section itself starts aligned
            raise ValueError(f"{path!r}: GGUF tensor {info.name!r} starts at byte {info.offset}, "
                             f"not a multiple of general.alignment={header.alignment}")
        end = info.offset + nbytes
        if end > header.file_size:
            raise ValueError(
                f"{path!r} is truncated: GGUF tensor {info.name!r} "
                f"({ggml_type_name(info.ggml_type)} {list(info.shape)}) needs bytes "
                f"{info.offset}..{end} but the file has {header.file_size} bytes; "
                "download it again")
        spans.append((info.offset, end, info.name))
    spans.sort()
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:], strict=False):
        if start_b < end_a:
            raise ValueError(f"{path!r}: the data of GGUF tensors {a!r} and {b!r} overlap (a "
                             "tensor's shape or type disagrees with the header's offsets)")


def expected_hf_shape(hf_name: str, config: ModelConfig) -> tuple[int, ...] | None:
    """The shape ``config`` implies for a Hugging Face weight name, or ``None`` if unknown.

    ``[out_features, in_features]`` for linear weights, ``[n]`` for norms and biases.
    """
    h, head_dim = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim, \
        config.intermediate_size
    globals_ = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,),
                "lm_head.weight": (config.vocab_size, h)}
    if hf_name in globals_:
        return globals_[hf_name]
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,), "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        return per_layer.get(parts[3])
    return None


def check_gguf_shapes(header: GGUFHeader, config: ModelConfig) -> None:
    """Check each weight's shape (and layer index) against the metadata-derived ``config``.

    Raises:
        ValueError: naming the file, the GGUF tensor, its shape and the expected one
            with the metadata keys it comes from (e.g. a ``token_embd.weight`` of
            ``[32000, 896]`` when ``vocab_size`` is 151936).
    """
    from llmserve.loader.gguf_loader import hf_tensor_name

    for info in header.tensors:
        hf_name = hf_tensor_name(info.name)
        if hf_name is None:
            continue
        if hf_name.startswith("model.layers."):
            layer = int(hf_name.split(".")[2])
            if layer >= config.num_hidden_layers:
                raise ValueError(f"{header.path!r}: GGUF tensor {info.name!r} belongs to layer "
                                 f"{layer}, but the metadata says block_count="
                                 f"{config.num_hidden_layers}")
        expected = expected_hf_shape(hf_name, config)
        if expected is not None and tuple(info.shape) != expected:
            raise ValueError(
                f"{header.path!r}: GGUF tensor {info.name!r} has shape {list(info.shape)} but the "
                f"metadata implies {list(expected)} (vocab_size={config.vocab_size}, "
                f"embedding_length={config.hidden_size}, feed_forward_length="
                f"{config.intermediate_size}, head_count={config.num_attention_heads}, "
                f"head_count_kv={config.num_key_value_heads}, head_dim={config.head_dim})")

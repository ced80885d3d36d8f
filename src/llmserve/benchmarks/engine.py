"""Helpers for the benchmarks: describe an engine's weights (format, bytes per token).
Build engines with ``LLM(quantization=...)`` / ``LLMEngine.from_engine_args``."""

from __future__ import annotations

import numpy as np
import torch

from llmserve.engine.llm import LLM


def weight_format_of(llm: LLM) -> str:
    """``"gguf-native"``, ``"gguf-hybrid"`` or ``"dense"``: how the linear layers run."""
    for module in llm.engine.runner.model.modules():
        method = getattr(module, "quant_method", None)
        config = getattr(method, "config", None)
        if config is not None and getattr(config, "name", ""):
            return config.name
    return "dense"


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear layer and the LM head.

    Packed native weights count their packed bytes (codes + scales), dense weights
    their dtype's; the embedding lookup (one row per token) is left out.
    """
    total = 0
    for module in model.modules():
        packed = getattr(getattr(module, "quant_method", None), "packed", None)
        if packed is not None:  # gguf-hybrid decodes from the packed weights too
            total += packed.nbytes()
        elif hasattr(module, "quant_method"):
            total += module.weight.numel() * module.weight.element_size()
    if getattr(model, "lm_head", None) is None:  # tied: the embedding table is the LM head
        table = model.model.embed_tokens.weight
        packed = getattr(table, "packed", None)
        total += packed.nbytes() if packed is not None else table.numel() * table.element_size()
    return total


def gguf_decode_bytes(path: str) -> int:
    """Bytes of a GGUF file's tensors that a decode step reads in its own format (what
    llama.cpp reads): every tensor except ``token_embd`` when an ``output`` tensor exists
    (an untied embedding is looked up one row per token)."""
    from gguf.quants import quant_shape_to_byte_shape

    from llmserve.loader.gguf_loader import read_gguf_header

    tensors = read_gguf_header(path).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    total = 0
    for t in tensors:
        if untied and t.name == "token_embd.weight":
            continue
        total += int(np.prod(quant_shape_to_byte_shape(t.shape, t.ggml_type)))
    return total

"""Hugging Face model directories: ``config.json`` and ``*.safetensors`` weights.

Layouts accepted (as written by ``transformers.PreTrainedModel.save_pretrained``)::

    model_dir/config.json
    model_dir/generation_config.json          (optional: extra eos ids)
    model_dir/model.safetensors               single file, or
    model_dir/model.safetensors.index.json    {"weight_map": {tensor name: shard file}}
    model_dir/model-0000k-of-0000n.safetensors

A quantized checkpoint (GPTQ, AWQ, compressed-tensors) names its method in
``config.json``'s ``quantization_config``; its quantized modules store several
tensors (``<m>.qweight``, ``<m>.scales``, ...) that may sit in different shards.
:func:`iter_safetensors_weights` reads each module's tensors together and yields one
``(<m>.weight, QuantizedTensor)`` (or its dequantized float32 weight).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from llmserve.config import ModelConfig
from llmserve.layers.quantization.base import QuantizedTensor
from llmserve.layers.quantization.int_group import CheckpointQuantizationConfig

SUPPORTED_HF_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
    "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Non-persistent buffers some old checkpoints saved; recomputed by the model.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path!r} must hold a JSON object")
    return data


def _generation_eos_ids(model_dir: str) -> list[int]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return []
    eos = _read_json(path).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def read_hf_config(model_dir: str) -> ModelConfig:
    """Read ``config.json`` (+ ``generation_config.json`` eos ids) into a :class:`ModelConfig`.

    Raises:
        ValueError: ``config.json`` missing or invalid, a required field missing, or an
            architecture outside :data:`SUPPORTED_HF_ARCHITECTURES`.
    """
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir!r} has no config.json; pass a Hugging Face model "
                         "directory or a GGUF file")
    cfg = _read_json(path)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_HF_ARCHITECTURES:
        raise ValueError(f"model architecture {arch!r} in {path!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}")
    return ModelConfig.from_hf_config(cfg, extra_eos=_generation_eos_ids(model_dir))


def safetensors_files(model_dir: str) -> list[str]:
    """Paths of the checkpoint's safetensors files, in shard order.

    Raises:
        ValueError: no ``model.safetensors`` / index, an invalid index, or a missing shard.
    """
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index!r} has no 'weight_map'")
        files = [os.path.join(model_dir, f) for f in sorted(set(weight_map.values()))]
    elif os.path.isfile(os.path.join(model_dir, SINGLE_FILE)):
        files = [os.path.join(model_dir, SINGLE_FILE)]
    else:
        raise ValueError(f"{model_dir!r} has no {SINGLE_FILE} or {INDEX_FILE} (PyTorch .bin "
                         "checkpoints are not supported; convert them to safetensors)")
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"safetensors shard(s) listed in the index are missing: {missing}")
    return files


def read_checkpoint_quantization(model_dir: str) -> CheckpointQuantizationConfig | None:
    """The checkpoint's own quantization (``quantization_config`` in ``config.json``) or None.

    Returns:
        A ``CheckpointQuantizationConfig`` (``llmserve.layers.quantization.int_group``).

    Raises:
        ValueError: an unknown ``quant_method`` or an unsupported field (the message names
            the config file and the field).
    """
    from llmserve.layers.quantization import checkpoint_quantization_config

    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    qc = _read_json(path).get("quantization_config")
    return None if qc is None else checkpoint_quantization_config(qc, path)


def _open_all(stack: contextlib.ExitStack, files: list[str]) -> dict[str, Any]:
    handles = {}
    for path in files:
        try:
            handles[path] = stack.enter_context(safe_open(path, framework="pt"))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path!r} is not a readable safetensors file: {e}") from None
    return handles


def _get(handle: Any, path: str, name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path!r}: cannot read tensor {name!r}: {e}") from None


def iter_safetensors_weights(model_dir: str, quantization: Any = None,
                             ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor, with names and dtypes as stored.

    Shapes are Hugging Face's (linear weights ``[out_features, in_features]``).
    ``*.rotary_emb.inv_freq`` buffers are skipped. A quantized checkpoint's modules
    come out as ``(<m>.weight, QuantizedTensor)`` when ``quantization`` is its
    ``CheckpointQuantizationConfig`` (from ``resolve_quantization``), else dequantized
    to float32 by the format's formula.

    Raises:
        ValueError: see :func:`safetensors_files`, :func:`read_checkpoint_quantization`;
            an unreadable file or tensor, or a malformed quantized module (naming the
            file and the tensor).
    """
    files = safetensors_files(model_dir)
    ckpt = read_checkpoint_quantization(model_dir)
    native = ckpt is not None and getattr(quantization, "name", None) == ckpt.name \
        and hasattr(quantization, "read_module")
    if native:
        ckpt = quantization
    with contextlib.ExitStack() as stack:
        handles = _open_all(stack, files)
        names = {path: [n for n in h.keys() if not n.endswith(_SKIPPED_SUFFIXES)]  # noqa: SIM118
                 for path, h in handles.items()}
        parts: dict[str, dict[str, str]] = defaultdict(dict)  # module -> suffix -> file
        if ckpt is not None:
            markers, suffixes = ckpt.marker_suffixes(), ckpt.module_suffixes()
            quantized = {n.rsplit(".", 1)[0] for ns in names.values() for n in ns
                         if n.rsplit(".", 1)[-1] in markers}
            for path, ns in names.items():
                for n in ns:
                    prefix, _, suffix = n.rpartition(".")
                    if prefix in quantized and suffix in suffixes:
                        parts[prefix][suffix] = path
        emitted: set[str] = set()
        for path, ns in names.items():
            for name in ns:
                prefix, _, suffix = name.rpartition(".")
                if prefix not in parts or suffix not in parts[prefix]:
                    yield name, _get(handles[path], path, name)
                    continue
                if prefix in emitted:
                    continue  # read once, with the module's first tensor
                emitted.add(prefix)
                tensors = {sfx: _get(handles[p], p, f"{prefix}.{sfx}")
                           for sfx, p in parts[prefix].items()}
                try:
                    qt = ckpt.read_module(prefix, tensors)
                except ValueError as e:
                    raise ValueError(f"{path!r}: {e}") from None
                yield f"{prefix}.weight", qt if native else qt.dequantize()

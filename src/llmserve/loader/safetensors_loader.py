"""Hugging Face model directories: ``config.json`` and ``*.safetensors`` weights.

Layouts accepted (as written by ``transformers.PreTrainedModel.save_pretrained``)::

    model_dir/config.json
    model_dir/generation_config.json          (optional: extra eos ids)
    model_dir/model.safetensors               single file, or
    model_dir/model.safetensors.index.json    {"weight_map": {tensor name: shard file}}
    model_dir/model-0000k-of-0000n.safetensors
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from llmserve.config import ModelConfig

SUPPORTED_HF_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
    "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM")
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


def iter_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor, with names and dtypes as stored.

    Shapes are Hugging Face's (linear weights ``[out_features, in_features]``).
    ``*.rotary_emb.inv_freq`` buffers are skipped.

    Raises:
        ValueError: see :func:`safetensors_files`.
    """
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith(_SKIPPED_SUFFIXES):
                    continue
                yield name, f.get_tensor(name)

"""Read a PEFT LoRA adapter directory into plain tensors.

A PEFT directory (``peft.PeftModel.save_pretrained``) holds::

    adapter_config.json          r, lora_alpha, target_modules, use_rslora, ...
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight  [r, in_features]
                                 base_model.model.<module>.lora_B.weight  [out_features, r]

PEFT computes ``y = base(x) + (x @ A^T @ B^T) * scaling`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``; Kalajdzievski 2023), ``r`` and ``lora_alpha``
overridden per module by ``rank_pattern`` / ``alpha_pattern``. The scaling is folded
into ``B`` here, as vLLM's ``LoRAModel.from_local_checkpoint`` does. Source: Hu et al.
2021 (LoRA); PEFT ``tuners/lora/layer.py``; vLLM ``vllm/lora/models.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."


@dataclass
class LoRALayerWeights:
    """One adapted projection: ``lora_a [r, in_features]``, ``lora_b [out_features, r]``
    (``scaling`` already multiplied in)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass
class PeftAdapter:
    """A parsed adapter: Hugging Face module name (``model.layers.0.self_attn.q_proj``)
    -> its weights; ``rank`` is the largest rank of any module."""

    path: str
    weights: dict[str, LoRALayerWeights]
    rank: int


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's ``get_pattern_key``: the value of the first pattern matching ``key``'s end."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def read_adapter_config(path: str) -> dict:
    """``adapter_config.json`` of ``path``, checked for what we support.

    Raises:
        ValueError: no such directory or file, not a LoRA adapter, or an unsupported
            option (DoRA, trained biases, ``modules_to_save``, ``fan_in_fan_out``).
    """
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r}: not a directory (expected a PEFT "
                         f"adapter directory with {CONFIG_NAME} and {WEIGHTS_NAME})")
    cfg_file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(cfg_file):
        raise ValueError(f"LoRA adapter {path!r}: no {CONFIG_NAME}")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path!r}: cannot read {CONFIG_NAME}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_NAME} is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {peft_type!r} is not LORA")
    if cfg.get("use_dora"):
        raise ValueError(f"LoRA adapter {path!r}: DoRA (use_dora) is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: trained biases (bias="
                         f"{cfg.get('bias')!r}) are not supported; only bias='none'")
    if cfg.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {path!r}: modules_to_save "
                         f"{cfg['modules_to_save']} is not supported")
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {path!r}: fan_in_fan_out is not supported")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"LoRA adapter {path!r}: {CONFIG_NAME} field {key!r} must be a "
                             f"positive number, got {v!r}")
    return cfg


def load_peft_adapter(path: str, dtype: torch.dtype = torch.float32) -> PeftAdapter:
    """Parse a PEFT LoRA directory; ``B`` carries the module's scaling.

    Returns:
        A :class:`PeftAdapter` keyed by Hugging Face module names.

    Raises:
        ValueError: naming the file or tensor: a missing or unreadable file, an
            unsupported option (see :func:`read_adapter_config`), a tensor that is not
            a LoRA A/B weight (embeddings, ``lm_head``), or A/B shapes that disagree.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg = read_adapter_config(path)
    weights_file = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights_file):
        hint = " (adapter_model.bin: re-save it with safe_serialization=True)" \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise ValueError(f"LoRA adapter {path!r}: no {WEIGHTS_NAME}{hint}")
    try:
        tensors = load_file(weights_file)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"LoRA adapter {path!r}: cannot read {WEIGHTS_NAME}: {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight",
                         name)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is not a LoRA A/B "
                             "weight of a linear layer (embedding and lm_head adapters are "
                             "not supported)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_NAME} holds no LoRA weights")
    use_rslora = bool(cfg.get("use_rslora", False))
    out: dict[str, LoRALayerWeights] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {path!r}: module {module!r} lacks "
                             f"{({'lora_A', 'lora_B'} - set(ab)).pop()}")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA adapter {path!r}: module {module!r}: lora_A "
                             f"{tuple(a.shape)} and lora_B {tuple(b.shape)} do not chain")
        r = int(a.shape[0])
        alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, cfg["lora_alpha"]))
        scaling = alpha / (math.sqrt(r) if use_rslora else r)
        out[module] = LoRALayerWeights(a.to(torch.float32).to(dtype).contiguous(),
                                       (b.to(torch.float32) * scaling).to(dtype).contiguous())
    return PeftAdapter(path, out, max(w.rank for w in out.values()))

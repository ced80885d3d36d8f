"""RoPE frequency scalings: the cos/sin table of every position, per ``rope_scaling``.

Semantics and parameter names follow ``transformers.modeling_rope_utils``
(``rope_type`` or the legacy ``type``)::

    "default"   inv_freq_i = base ** (-2i / d)                     (RoFormer, Su et al. 2021)
    "linear"    inv_freq / factor                                  (position interpolation,
                                                                    Chen et al. 2023)
    "llama3"    long wavelengths / factor, short ones kept, smooth in between (Llama 3.1)
    "yarn"      NTK-by-parts ramp between interpolation and extrapolation, cos/sin
                times attention_factor (0.1 ln(factor) + 1 by default)  (Peng et al. 2023)
    "dynamic"   NTK-aware base growing with the sequence length beyond
                max_position_embeddings                            (bloc97 / emozilla)
    "longrope"  per-frequency short_factor up to original_max_position_embeddings,
                long_factor beyond; cos/sin times attention_factor (Phi-3, Ding et al. 2024)

``d`` is the rotated width (``head_dim * partial_rotary_factor``).

Position-dependent types, decided per token, so that batching and chunking never
change a token's rotation: transformers picks the frequencies of a whole forward
pass from its largest position (``seq_len = max(position_ids) + 1``). A token at
position ``p`` here uses those of ``seq_len = p + 1``: "dynamic" rotates it with
the base of ``max(p + 1, max_position_embeddings)`` and "longrope" with the long
factors iff ``p >= original_max_position_embeddings``. That is exactly what
transformers computes while it generates token by token and for every prompt that
fits in the original context; only a prompt longer than that differs (transformers
rotates all of it with the frequencies of its full length).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    """``rope_scaling["rope_type"]`` (or legacy ``"type"``); ``"default"`` when absent."""
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def _param(rope_scaling: dict[str, Any], key: str, rope_type: str) -> Any:
    try:
        value = rope_scaling[key]
    except KeyError:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs the field {key!r}") from None
    if value is None:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs the field {key!r}")
    return value


def _base_inv_freq(dim: int, base: float | torch.Tensor) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim / 2]
    return 1.0 / (base ** exponents)


def _llama3(inv_freq: torch.Tensor, rs: dict[str, Any]) -> torch.Tensor:
    factor = float(_param(rs, "factor", "llama3"))
    low_freq_factor = float(_param(rs, "low_freq_factor", "llama3"))
    high_freq_factor = float(_param(rs, "high_freq_factor", "llama3"))
    old_context_len = float(_param(rs, "original_max_position_embeddings", "llama3"))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, rs: dict[str, Any],
          max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    orig = float(_param(rs, "original_max_position_embeddings", "yarn"))
    factor = rs.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / orig
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope(dim: int, base: float, rs: dict[str, Any], positions: torch.Tensor,
              max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Per-position inv_freq ``[P, dim / 2]``: short factors below the original context."""
    orig = int(_param(rs, "original_max_position_embeddings", "longrope"))
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = _param(rs, key, "longrope")
        if len(values) != dim // 2:
            raise ValueError(f"rope_scaling.{key} has {len(values)} values; the rotary "
                             f"dimension {dim} needs {dim // 2}")
        factors[key] = torch.tensor(values, dtype=torch.float32)
    factor = rs.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / orig
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else \
            math.sqrt(1 + math.log(factor) / math.log(orig))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short = 1.0 / (factors["short_factor"] * base ** shape)
    long = 1.0 / (factors["long_factor"] * base ** shape)
    inv_freq = torch.where((positions >= orig)[:, None], long[None], short[None])
    return inv_freq, float(attention_factor)


def _dynamic(dim: int, base: float, rs: dict[str, Any], positions: torch.Tensor,
             max_position_embeddings: int) -> torch.Tensor:
    """Per-position inv_freq ``[P, dim / 2]``, the base of a ``max(p + 1, L)``-token sequence."""
    factor = float(_param(rs, "factor", "dynamic"))
    seq_len = torch.clamp(positions + 1, min=max_position_embeddings).float()  # [P]
    bases = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(dim, bases[:, None])


def compute_inv_freq(head_dim: int, base: float,
                     rope_scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Position-independent inverse frequencies ``[head_dim / 2]`` (float32):
    types "default", "linear" and "llama3" (see :func:`rope_cos_sin` for all types).

    Raises:
        ValueError: another rope type (the message names it), or a missing field.
    """
    rope_type = rope_type_of(rope_scaling)
    inv_freq = _base_inv_freq(head_dim, base)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(_param(rope_scaling, "factor", rope_type))
    if rope_type == "llama3":
        return _llama3(inv_freq, rope_scaling)
    raise ValueError(f"compute_inv_freq: rope type {rope_type!r} is position-dependent or "
                     "scales cos/sin; use rope_cos_sin")


def rope_cos_sin(rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None,
                 max_position_embeddings: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[max_position, rotary_dim / 2]`` (float32) of positions ``0 ..
    max_position - 1``, scaled per ``rope_scaling`` (see the module docstring).

    Args:
        rotary_dim: the rotated width of a head (even).
        max_position: rows of the table (the longest context served).
        base: ``rope_theta``.
        rope_scaling: Hugging Face ``rope_scaling`` / ``rope_parameters`` dict, or None.
        max_position_embeddings: the model's ``max_position_embeddings`` (default
            ``max_position``), used by "dynamic", "yarn" and "longrope".

    Raises:
        ValueError: an unsupported rope type (the message names it and lists the
            supported ones), a missing field, or factor lists of the wrong length.
    """
    rope_type = rope_type_of(rope_scaling)
    max_pos_emb = max_position_embeddings or max_position
    positions = torch.arange(max_position, dtype=torch.int64)
    attention_factor = 1.0
    if rope_type in ("default", "linear", "llama3"):
        inv_freq = compute_inv_freq(rotary_dim, base, rope_scaling)[None]
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(rotary_dim, base, rope_scaling, max_pos_emb)
        inv_freq = inv_freq[None]
    elif rope_type == "longrope":
        inv_freq, attention_factor = _longrope(rotary_dim, base, rope_scaling, positions,
                                               max_pos_emb)
    elif rope_type == "dynamic":
        inv_freq = _dynamic(rotary_dim, base, rope_scaling, positions, max_pos_emb)
    else:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; "
                         f"supported: {list(SUPPORTED_ROPE_TYPES)}")
    freqs = positions.float()[:, None] * inv_freq  # [max_position, rotary_dim / 2]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor

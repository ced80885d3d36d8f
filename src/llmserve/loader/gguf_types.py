"""GGUF tensor types: which ones load, their sizes in bytes, and dequantization to float32.

Every ggml type that the ``gguf`` package (llama.cpp's ``gguf-py``) can dequantize
loads, through ``gguf.quants.dequantize`` (llama.cpp's reference formulas in numpy):
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ1_S,
IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4,
NVFP4 (as of gguf 0.19). A few simple types it has no formula for are dequantized
here, after ggml (``ggml-quants.c``, ``ggml.c``)::

    Q8_K  292 B per 256 values: | d f32 | 256 x int8 q | 16 x int16 bsums |   w = d * q
    F64, I8, I16, I32, I64      plain little-endian elements, cast to float32

A type id the installed ``gguf`` does not know (a file from a newer llama.cpp), or one
it knows but cannot dequantize (e.g. Q8_1, whose block size gguf-py and ggml disagree
on), is a ValueError naming the tensor and the type.
"""

from __future__ import annotations

import importlib.metadata

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

_Q = GGMLQuantizationType
_PLAIN = {_Q.F64: np.float64, _Q.I8: np.int8, _Q.I16: np.int16, _Q.I32: np.int32,
          _Q.I64: np.int64}
_OWN = frozenset({_Q.Q8_K, *_PLAIN})


def gguf_package_version() -> str:
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - vendored gguf
        return "unknown"


def _gguf_can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` has a formula for ``qtype`` (tried on one zero
    block: gguf-py raises NotImplementedError for the types it lacks)."""
    if qtype not in GGML_QUANT_SIZES:
        return False
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    try:
        _gguf_dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _loadable() -> frozenset[GGMLQuantizationType]:
    try:  # gguf-py's registry of formula classes (cheap; probing builds the IQ grids, ~10 s)
        from gguf.quants import _type_traits
    except ImportError:  # pragma: no cover - a gguf without the registry
        return frozenset(t for t in _Q if t in _OWN or _gguf_can_dequantize(t))
    return frozenset(t for t in _Q if t in _OWN or t in (_Q.F32, _Q.F16) or t in _type_traits)


#: ggml types whose tensors load (dequantized to float32).
LOADABLE_GGUF_TYPES: frozenset[GGMLQuantizationType] = _loadable()


def ggml_type_name(type_id: int) -> str:
    """ggml type id -> name (``"Q4_K"``); ``"unknown type id <n>"`` if gguf does not know it."""
    try:
        return _Q(type_id).name
    except ValueError:
        return f"unknown type id {type_id}"


def check_loadable(path: str, name: str, type_id: int) -> GGMLQuantizationType:
    """The tensor's :class:`GGMLQuantizationType`, if it can be loaded.

    Raises:
        ValueError: naming the file, the tensor and the type, for a type id unknown to
            the installed ``gguf`` package or one it has no dequantization for.
    """
    try:
        qtype = _Q(type_id)
    except ValueError:
        raise ValueError(
            f"{path!r}: GGUF tensor {name!r} has ggml type id {type_id}, which the installed "
            f"gguf package ({gguf_package_version()}) does not know; the file was probably "
            "written by a newer llama.cpp: upgrade gguf (pip install -U gguf)") from None
    if qtype not in LOADABLE_GGUF_TYPES:
        loadable = ", ".join(sorted(t.name for t in LOADABLE_GGUF_TYPES))
        raise ValueError(
            f"{path!r}: GGUF tensor {name!r} has type {qtype.name}, which is not supported "
            f"(gguf {gguf_package_version()} cannot dequantize it); supported types: {loadable}")
    return qtype


def tensor_nbytes(path: str, name: str, shape: tuple[int, ...], type_id: int) -> int:
    """Bytes of tensor data for ``shape`` (numpy order, innermost last) of ``type_id``.

    Raises:
        ValueError: unsupported type (see :func:`check_loadable`), or a row length that
            is not a whole number of the type's blocks.
    """
    qtype = check_loadable(path, name, type_id)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row = shape[-1] if shape else 1
    if row % block_size:
        raise ValueError(f"{path!r}: GGUF tensor {name!r} of type {qtype.name} has rows of {row} "
                         f"values, not a multiple of its block size {block_size}")
    return int(np.prod(shape[:-1], dtype=np.int64)) * (row // block_size) * type_size


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Dequantize raw tensor bytes uint8 ``[..., bytes per row]`` to float32 ``[..., row]``.

    The result may be a read-only view of ``raw`` (F32); callers copy when they keep it.
    """
    if qtype in _PLAIN:
        return raw.view(_PLAIN[qtype]).astype(np.float32)
    if qtype == _Q.Q8_K:  # ggml-quants.c dequantize_row_q8_K
        blocks = raw.reshape(-1, 292)
        d = blocks[:, :4].copy().view(np.float32)  # [n_blocks, 1]
        q = blocks[:, 4:260].view(np.int8).astype(np.float32)
        return (d * q).reshape(*raw.shape[:-1], raw.shape[-1] // 292 * 256)
    return _gguf_dequantize(raw, qtype)

"""Paged-KV attention backends and their registry (keyed by ``name``)."""

from __future__ import annotations

from llmserve.layers.attention.backend import AttentionBackend, CommonAttentionMetadata
from llmserve.layers.attention.cpu import CpuAttentionBackend, CpuAttentionMetadata
from llmserve.layers.attention.reference import ReferenceAttentionBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Register a backend class under ``cls.name`` (usable as a decorator).

    Raises:
        ValueError: when another class is already registered under that name.
    """
    existing = _BACKENDS.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"attention backend {cls.name!r} is already registered")
    _BACKENDS[cls.name] = cls
    return cls


def get_attn_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name``.

    Raises:
        ValueError: for an unknown name; the message lists the registered ones.
    """
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}") from None


def available_backends() -> list[str]:
    """Sorted names of the registered backends."""
    return sorted(_BACKENDS)


register_backend(ReferenceAttentionBackend)
register_backend(CpuAttentionBackend)

__all__ = [
    "AttentionBackend",
    "CommonAttentionMetadata",
    "CpuAttentionBackend",
    "CpuAttentionMetadata",
    "ReferenceAttentionBackend",
    "available_backends",
    "get_attn_backend",
    "register_backend",
]

"""KV eviction policies behind one interface (:class:`EvictionPolicy`), one per file,
registered by name: ``none``, ``streaming_llm``, ``h2o``, ``snapkv``."""

from __future__ import annotations

from llmserve.kv_cache.eviction.base import EvictionPolicy, EvictionState
from llmserve.kv_cache.eviction.h2o import H2OPolicy
from llmserve.kv_cache.eviction.snapkv import SnapKVPolicy
from llmserve.kv_cache.eviction.streaming_llm import StreamingLLMPolicy
from llmserve.utils import cdiv

_POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_eviction_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Register a policy class under ``cls.name`` (usable as a decorator).

    Raises:
        ValueError: when another class already has that name.
    """
    existing = _POLICIES.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"KV eviction policy {cls.name!r} is already registered")
    _POLICIES[cls.name] = cls
    return cls


def available_eviction_policies() -> list[str]:
    """``"none"`` and the registered names, sorted."""
    return sorted(["none", *_POLICIES])


def get_eviction_policy(name: str) -> EvictionPolicy:
    """An instance of the policy registered as ``name``.

    Raises:
        ValueError: for an unknown name (the message lists the known ones).
    """
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown kv_eviction_policy {name!r}; available: "
                         f"{available_eviction_policies()}")
    return cls()


def make_eviction_state(policy: str, budget_tokens: int | None, num_sink_tokens: int,
                        window_tokens: int, block_size: int) -> EvictionState | None:
    """A request's :class:`EvictionState`, or None for ``policy == "none"``.

    Raises:
        ValueError: an unknown policy, no or a non-positive budget, a negative sink count,
            or a budget too small for what the policy always keeps.
    """
    if policy == "none":
        return None
    impl = get_eviction_policy(policy)
    if budget_tokens is None or isinstance(budget_tokens, bool) or \
            not isinstance(budget_tokens, int) or budget_tokens <= 0:
        raise ValueError(f"kv_eviction_policy {policy!r} needs kv_budget_tokens > 0, "
                         f"got {budget_tokens!r}")
    if isinstance(num_sink_tokens, bool) or not isinstance(num_sink_tokens, int) \
            or num_sink_tokens < 0:
        raise ValueError(f"num_sink_tokens must be an int >= 0, got {num_sink_tokens!r}")
    state = EvictionState(impl, budget_tokens // block_size, cdiv(num_sink_tokens, block_size),
                          cdiv(window_tokens, block_size), window_tokens, block_size)
    impl.check(state)
    return state


for _cls in (StreamingLLMPolicy, H2OPolicy, SnapKVPolicy):
    register_eviction_policy(_cls)

__all__ = ["EvictionPolicy", "EvictionState", "H2OPolicy", "SnapKVPolicy",
           "StreamingLLMPolicy", "available_eviction_policies", "get_eviction_policy",
           "make_eviction_state", "register_eviction_policy"]

"""Per-sequence KV caps applied by the scheduler before a step's slots are allocated.

Two sources, both freeing whole blocks back to the pool at once
(``KVCacheManager.evict_blocks``; the block table keeps the rest, in order):

* **Sliding window** (every layer windowed, Mistral-style): a query at position
  ``q`` sees keys ``k > q - W``, and a step's first query sits at
  ``num_computed_tokens``, so every block ending at or before
  ``num_computed_tokens - W`` is never read again and is freed. A sequence then holds
  at most ``ceil((W + chunk) / block_size) + 1`` blocks, whatever its length.
  Mixed models (Gemma 3's local and global layers) keep their local layers' KV in a
  second pool whose blocks slide out instead (``kv_cache/window_blocks.py``,
  :func:`window_kv_for`); the limiter frees nothing for them.
* **An eviction policy** (``kv_cache/eviction``): a budget of blocks per sequence;
  the policy picks which kept blocks go.

Source: vLLM v1's ``SlidingWindowManager`` (``remove_skipped_blocks``) for the window
rule; the eviction policies' own docstrings for theirs.
"""

from __future__ import annotations

import logging

from llmserve.config import EngineConfig
from llmserve.kv_cache import KVCacheManager
from llmserve.kv_cache.eviction import EvictionState, make_eviction_state
from llmserve.kv_cache.window_blocks import WindowKVLayout, window_kv_layout
from llmserve.utils import cdiv

logger = logging.getLogger("llmserve")


class KVLimiter:
    """Frees the blocks a sequence no longer needs (see the module docstring).

    Args:
        kv: the block manager.
        sliding_window: the window of every layer (None: no window freeing).
        policy, budget_tokens, num_sink_tokens, window_tokens: the engine's eviction
            defaults (``--kv-eviction-policy`` ...), overridable per request through
            ``SamplingParams.kv_eviction_policy`` / ``kv_budget_tokens`` / ``num_sink_tokens``.

    Raises:
        ValueError: a sliding window together with an eviction policy (the window's
            mask is applied to kept positions, which eviction makes non-contiguous).
    """

    def __init__(self, kv: KVCacheManager, sliding_window: int | None = None,
                 policy: str = "none", budget_tokens: int | None = None,
                 num_sink_tokens: int = 4, window_tokens: int = 64) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.sliding_window = sliding_window
        self.policy = policy
        self.budget_tokens = budget_tokens
        self.num_sink_tokens = num_sink_tokens
        self.window_tokens = window_tokens
        if sliding_window is not None and policy != "none":
            raise ValueError("kv_eviction_policy needs a model without a sliding window "
                             "(its blocks are freed by the window already)")
        make_eviction_state(policy, budget_tokens, num_sink_tokens, window_tokens,
                            self.block_size)  # check the defaults now (ValueError)

    def make_state(self, params) -> EvictionState | None:
        """A request's eviction state from the engine defaults and its overrides.

        Raises:
            ValueError: as :func:`make_eviction_state`, or an override with a sliding window.
        """
        policy = getattr(params, "kv_eviction_policy", None)
        budget = getattr(params, "kv_budget_tokens", None)
        sinks = getattr(params, "num_sink_tokens", None)
        if self.sliding_window is not None and policy not in (None, "none"):
            raise ValueError("kv_eviction_policy needs a model without a sliding window")
        if self.kv.window_blocks is not None and policy not in (None, "none"):
            raise ValueError("kv_eviction_policy needs one KV pool; this engine keeps its "
                             "local layers' KV in a window pool (enable prefix caching "
                             "to keep one pool)")
        return make_eviction_state(self.policy if policy is None else policy,
                                   self.budget_tokens if budget is None else budget,
                                   self.num_sink_tokens if sinks is None else sinks,
                                   self.window_tokens, self.block_size)

    def max_blocks(self, state: EvictionState | None, max_chunk: int) -> int | None:
        """Most blocks a capped sequence holds during a step with ``max_chunk`` tokens,
        or None when it is not capped while its prompt is computed."""
        bs = self.block_size
        if self.sliding_window is not None:
            return cdiv(self.sliding_window + max_chunk, bs) + 1
        if state is not None and state.policy.evict_during_prefill:
            return state.budget_blocks + cdiv(max_chunk, bs) + 1
        return None

    def before_allocate(self, req, num_slots: int) -> None:
        """Free what ``req`` no longer needs before ``num_slots`` slots are allocated
        after its ``num_computed_tokens`` (the step's first query position)."""
        kv, rid, bs = self.kv, req.request_id, self.block_size
        blocks = kv.req_to_blocks.get(rid)
        if not blocks:
            return
        evicted = kv.num_evicted_tokens.get(rid, 0)
        computed = req.num_computed_tokens - evicted  # tokens in the kept blocks
        num_evictable = max(0, min(computed // bs, len(blocks) - 1))
        if self.sliding_window is not None:
            # kept blocks are the logical ones from evicted // bs on (a freed prefix)
            dead = (req.num_computed_tokens - self.sliding_window + 1) // bs - evicted // bs
            n = min(max(0, dead), num_evictable)
            if n:
                kv.evict_blocks(rid, list(range(n)))
            return
        state: EvictionState | None = getattr(req, "eviction", None)
        if state is None:
            return
        state.sync(len(blocks))
        if not state.policy.evict_during_prefill and \
                req.num_computed_tokens < req.num_prompt_tokens:
            return
        need = max(len(blocks), cdiv(computed + num_slots, bs))
        over = min(need - state.budget_blocks, num_evictable)
        if over <= 0:
            return
        picked = state.policy.select(state, num_evictable, over, req.num_prompt_tokens)
        if picked:
            kv.evict_blocks(rid, picked)
            state.drop(picked)

    @staticmethod
    def score_from(req, num_new: int) -> int | None:
        """The first query position whose attention the runner accumulates into the
        request's block scores this step (None: none)."""
        state: EvictionState | None = getattr(req, "eviction", None)
        if state is None or not state.policy.needs_scores:
            return None
        return state.policy.score_from(state, req.num_prompt_tokens, req.num_computed_tokens,
                                       num_new)


def kv_limiter_for(config: EngineConfig, kv_manager: KVCacheManager) -> KVLimiter | None:
    """The engine's limiter: sliding-window freeing (when every layer is windowed) and KV
    eviction, or None under speculative decoding (its verifier lays out slots itself).
    Logs the per-sequence block cap.

    Raises:
        ValueError: eviction with speculative decoding, or bad eviction settings.
    """
    cc, mc = config.cache_config, config.model_config
    window = mc.sliding_window if all(
        mc.layer_sliding_window(i) is not None for i in range(mc.num_hidden_layers)) \
        else None
    spec = config.speculative_config is not None
    if spec and cc.kv_eviction_policy != "none":
        raise ValueError("kv_eviction_policy is not supported with speculative decoding")
    if spec:
        return None
    limiter = KVLimiter(kv_manager, window, cc.kv_eviction_policy, cc.kv_budget_tokens,
                        cc.num_sink_tokens)
    cap = limiter.max_blocks(limiter.make_state(None),
                             config.scheduler_config.max_num_batched_tokens)
    if cap is not None:
        logger.info("KV per sequence capped at %d blocks (%s)", cap,
                    f"sliding window {window}" if window else
                    f"{cc.kv_eviction_policy}, budget {cc.kv_budget_tokens} tokens")
    return limiter


def window_kv_for(config: EngineConfig) -> tuple[WindowKVLayout | None, str]:
    """The two-pool layout of a mixed model (``kv_cache/window_blocks.py``), or
    ``(None, why not)``: every layer alike, or a feature that needs every layer's blocks
    (prefix caching, swap preemption, KV eviction, speculative decoding, a shared KV
    store, pipeline stages)."""
    cc, mc, sc = config.cache_config, config.model_config, config.scheduler_config
    conflicts = [name for name, on in (
        ("prefix caching", cc.enable_prefix_caching),
        ("swap preemption", sc.preemption_mode == "swap"),
        ("KV eviction", cc.kv_eviction_policy != "none"),
        ("speculative decoding", config.speculative_config is not None),
        ("a shared KV store", cc.kv_store is not None),
        ("pipeline parallelism", config.parallel_config.pipeline_parallel_size > 1),
    ) if on]
    return window_kv_layout([mc.layer_sliding_window(i) for i in range(mc.num_hidden_layers)],
                            cc.block_size, sc.max_num_seqs, sc.max_num_batched_tokens,
                            conflicts)

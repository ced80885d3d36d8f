"""Statistics the async engine publishes after every loop iteration.

Pure Python (no torch, no prometheus_client), so the engine can produce them and
any number of exporters can consume them. Definitions follow vLLM's
(``vllm/v1/metrics/stats.py``): TTFT is arrival to first token, TPOT is
``(e2e - TTFT) / (output tokens - 1)``, ITL is every gap between two tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from llmserve.outputs import RequestOutput


@dataclass(frozen=True)
class EngineStatsSnapshot:
    """Engine state right after one loop iteration (a consistent, immutable copy).

    Attributes:
        num_running_reqs: requests holding KV blocks and being stepped.
        num_waiting_reqs: requests queued in the scheduler (not yet admitted or
            preempted), plus adds submitted but not yet taken by the engine thread.
        kv_cache_usage: fraction of usable KV blocks in use, in [0, 1] (vLLM's
            ``kv_cache_usage_perc`` has the same 0..1 range despite its name).
        num_preemptions_total: preemptions since start (monotonic).
        num_steps_total: engine steps that ran the model since start.
        max_batch_size_seen: most requests scheduled in one step since start.
        prefix_cache_queries_total: prompt tokens looked up in the prefix cache.
        prefix_cache_hits_total: prompt tokens found there (monotonic).
        kv_store_hits_total: prompt tokens loaded from the shared KV store (``--kv-store``).
        spec_decoding: speculative-decoding counters since start
            (``SpecDecodingStats.as_dict()``), None when speculation is off.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    num_steps_total: int = 0
    max_batch_size_seen: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    kv_store_hits_total: int = 0
    spec_decoding: dict | None = None


@dataclass
class IterationStats:
    """What one engine-loop iteration did.

    Attributes:
        snapshot: the engine state after the iteration.
        outputs: every RequestOutput produced (DELTA kind: each carries only the new
            tokens), including the final ``abort`` outputs of aborted requests.
        step_num_reqs: requests scheduled in the model step (0 if no step ran).
        step_num_tokens: tokens scheduled in the model step (prefill + decode).
    """

    snapshot: EngineStatsSnapshot
    outputs: list[RequestOutput] = field(default_factory=list)
    step_num_reqs: int = 0
    step_num_tokens: int = 0


class StatLogger(Protocol):
    """Consumes :class:`IterationStats`. Called on the engine thread after every
    iteration, so ``record`` must be quick and thread-safe towards its readers;
    an exception it raises is logged and ignored."""

    def record(self, stats: IterationStats) -> None: ...

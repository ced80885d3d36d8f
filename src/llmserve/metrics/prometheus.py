"""Prometheus exporter of engine statistics, with vLLM's metric names under the
``llmserve:`` prefix (vLLM: ``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``).

Every series carries the label ``model_name``. Units are seconds for times and a
0..1 fraction for ``kv_cache_usage_perc`` (as in vLLM, despite the name).

=========================================  =========  =====================================
name                                       type       what
=========================================  =========  =====================================
llmserve:num_requests_running              gauge      requests in the running batch
llmserve:num_requests_waiting              gauge      requests queued (not yet admitted)
llmserve:kv_cache_usage_perc               gauge      used KV blocks / usable blocks, 0..1
llmserve:max_batch_size                    gauge      most requests in one step since start
llmserve:prompt_tokens_total               counter    prompt tokens of requests that prefilled
llmserve:generation_tokens_total           counter    generated tokens
llmserve:num_preemptions_total             counter    preemptions (recompute or swap)
llmserve:prefix_cache_queries_total        counter    prompt tokens looked up in the prefix cache
llmserve:prefix_cache_hits_total           counter    prompt tokens found in the prefix cache
llmserve:kv_store_hits_total               counter    prompt tokens loaded from the shared KV store
llmserve:request_success_total             counter    finished requests, by ``finished_reason``
                                                      (stop, length, abort)
llmserve:time_to_first_token_seconds       histogram  arrival -> first token (TTFT)
llmserve:inter_token_latency_seconds       histogram  every gap between two tokens (ITL)
llmserve:time_per_output_token_seconds     histogram  (e2e - TTFT) / (output tokens - 1)
llmserve:e2e_request_latency_seconds       histogram  arrival -> finished
llmserve:request_queue_time_seconds        histogram  arrival -> first scheduled
llmserve:iteration_tokens_total            histogram  tokens scheduled per engine step
llmserve:iteration_num_requests            histogram  requests scheduled per engine step
                                                      (the batch size; > 1 means batching)
=========================================  =========  =====================================
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from llmserve.metrics.stats import IterationStats

PREFIX = "llmserve:"
# Buckets as in vLLM (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class PrometheusStatLogger:
    """A :class:`~llmserve.metrics.stats.StatLogger` that keeps Prometheus metrics.

    Args:
        model_name: value of the ``model_name`` label.
        registry: where the metrics live; a fresh one by default (so several
            servers or tests in one process do not collide).
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        reg, lbl = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, lbl, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, lbl, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, lbl, buckets=buckets,
                             registry=reg).labels(model_name)

        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc",
                              "KV cache usage: used blocks / usable blocks (1 = 100 percent).")
        self.max_batch_size = gauge("max_batch_size",
                                    "Most requests scheduled in one engine step since start.")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.")
        self.kv_store_hits = counter("kv_store_hits",
                                     "Prompt tokens loaded from the shared KV store.")
        self._last_kv_store_hits = 0
        self._success = Counter(PREFIX + "request_success", "Finished requests.",
                                ["model_name", "finished_reason"], registry=reg)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Time to first token (arrival to first token), seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Gap between two consecutive output tokens, seconds.",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "(e2e - TTFT) / (output tokens - 1), seconds.",
                              TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Arrival to finish, seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to first scheduled, seconds.",
                                    REQUEST_LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total",
                                          "Tokens scheduled per engine step.",
                                          ITERATION_TOKENS_BUCKETS)
        self.iteration_reqs = histogram("iteration_num_requests",
                                        "Requests scheduled per engine step (batch size).",
                                        BATCH_SIZE_BUCKETS)
        self._lock = threading.Lock()
        self._num_generated: dict[str, int] = {}  # request id -> output tokens so far
        self._last_preemptions = 0
        self._last_prefix = (0, 0)
        self._spec = None  # speculative-decoding counters, created when first reported
        self._last_spec: dict = {}

    def record(self, stats: IterationStats) -> None:
        """Update the metrics from one engine iteration (engine thread)."""
        snap = stats.snapshot
        self.num_running.set(snap.num_running_reqs)
        self.num_waiting.set(snap.num_waiting_reqs)
        self.kv_usage.set(snap.kv_cache_usage)
        self.max_batch_size.set(snap.max_batch_size_seen)
        with self._lock:
            if snap.num_preemptions_total > self._last_preemptions:
                self.preemptions.inc(snap.num_preemptions_total - self._last_preemptions)
                self._last_preemptions = snap.num_preemptions_total
            queries, hits = snap.prefix_cache_queries_total, snap.prefix_cache_hits_total
            if queries > self._last_prefix[0]:
                self.prefix_queries.inc(queries - self._last_prefix[0])
                self.prefix_hits.inc(hits - self._last_prefix[1])
                self._last_prefix = (queries, hits)
            if snap.kv_store_hits_total > self._last_kv_store_hits:
                self.kv_store_hits.inc(snap.kv_store_hits_total - self._last_kv_store_hits)
                self._last_kv_store_hits = snap.kv_store_hits_total
            if snap.spec_decoding is not None:
                self._record_spec(snap.spec_decoding)
            if stats.step_num_reqs:
                self.iteration_tokens.observe(stats.step_num_tokens)
                self.iteration_reqs.observe(stats.step_num_reqs)
            for out in stats.outputs:
                self._record_output(out)

    def _record_spec(self, spec: dict) -> None:
        """vLLM's ``spec_decode_*`` counters, from the engine's cumulative totals."""
        reg, name = self.registry, self.model_name
        if self._spec is None:
            def counter(metric: str, doc: str) -> Counter:
                return Counter(PREFIX + metric, doc, ["model_name"], registry=reg).labels(name)

            self._spec = {
                "num_drafts": counter("spec_decode_num_drafts",
                                      "Verification steps with at least one draft token."),
                "num_draft_tokens": counter("spec_decode_num_draft_tokens",
                                            "Draft tokens verified."),
                "num_accepted_tokens": counter("spec_decode_num_accepted_tokens",
                                               "Draft tokens accepted."),
                "per_pos": Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                   "Draft tokens accepted, by draft position (0-based).",
                                   ["model_name", "position"], registry=reg),
            }
        last = self._last_spec
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            delta = spec[key] - last.get(key, 0)
            if delta > 0:
                self._spec[key].inc(delta)
        old = last.get("num_accepted_tokens_per_pos", [])
        for pos, total in enumerate(spec["num_accepted_tokens_per_pos"]):
            child = self._spec["per_pos"].labels(name, str(pos))
            delta = total - (old[pos] if pos < len(old) else 0)
            if delta > 0:
                child.inc(delta)
        self._last_spec = spec

    def _record_output(self, out) -> None:
        rid = out.request_id
        new_tokens = len(out.outputs[0].token_ids) if out.outputs else 0
        if rid not in self._num_generated:
            self._num_generated[rid] = 0
            if new_tokens or not out.finished:  # it prefilled (not aborted while waiting)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                m = out.metrics
                if m is not None and m.time_to_first_token is not None:
                    self.ttft.observe(max(m.time_to_first_token, 0.0))
        self._num_generated[rid] += new_tokens
        self.generation_tokens.inc(new_tokens)
        if not out.finished:
            return
        num_generated = self._num_generated.pop(rid)
        reason = out.outputs[0].finish_reason if out.outputs else "abort"
        self._success.labels(self.model_name, reason or "abort").inc()
        m = out.metrics
        if m is None:
            return
        for gap in out.itl:
            self.itl.observe(gap)
        if m.e2e_latency is not None:
            self.e2e.observe(max(m.e2e_latency, 0.0))
        if m.time_in_queue is not None:
            self.queue_time.observe(max(m.time_in_queue, 0.0))
        ttft = m.time_to_first_token
        if ttft is not None and m.e2e_latency is not None and num_generated > 1:
            self.tpot.observe(max(m.e2e_latency - ttft, 0.0) / (num_generated - 1))

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

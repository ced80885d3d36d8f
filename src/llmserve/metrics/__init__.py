"""Engine statistics: plain snapshots (:mod:`.stats`, no dependencies) and the
Prometheus exporter (:mod:`.prometheus`, needs ``prometheus_client``)."""

from llmserve.metrics.stats import EngineStatsSnapshot, IterationStats, StatLogger

__all__ = ["EngineStatsSnapshot", "IterationStats", "StatLogger"]

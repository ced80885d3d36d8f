"""Writes ``llmserve.json``, the Grafana dashboard of llmserve's engine, router and
gateway metrics (layout after vLLM's ``examples/online_serving/prometheus_grafana/
grafana.json``: latency quantiles beside throughput, scheduler state beside cache
usage). Run ``python deploy/grafana/make_dashboard.py`` after changing it; the test
``tests/test_grafana.py`` checks every metric a query names is exported by the code.
Import the JSON in Grafana (Dashboards -> Import) and pick a Prometheus data source.
"""

from __future__ import annotations

import json
import os

DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
M = '{model_name=~"$model_name"}'
MLE = 'model_name=~"$model_name"'
RI = "$__rate_interval"
QS = (0.99, 0.95, 0.9, 0.5)


def quantiles(metric: str, sel: str = MLE, by: str = "le") -> list[tuple[str, str]]:
    out = [(f"histogram_quantile({q}, sum by({by}) (rate({metric}_bucket{{{sel}}}[{RI}])))",
            f"P{round(q * 100)}") for q in QS]
    out.append((f"rate({metric}_sum{{{sel}}}[{RI}]) / rate({metric}_count{{{sel}}}[{RI}])",
                "Average"))
    return out


class Board:
    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y = 0, self.y + 8
        self.panels.append({"type": "row", "title": title, "id": self._id(), "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def panel(self, title: str, description: str, targets: list[tuple[str, str]],
              unit: str = "short", kind: str = "timeseries") -> None:
        p = {"type": kind, "title": title, "description": description, "id": self._id(),
             "datasource": DS, "gridPos": {"h": 8, "w": 12, "x": self.x, "y": self.y},
             "fieldConfig": {"defaults": {"unit": unit, "custom": {"lineWidth": 1,
                                                                  "fillOpacity": 10}},
                             "overrides": []},
             "options": {"legend": {"displayMode": "list", "placement": "bottom",
                                    "showLegend": True},
                         "tooltip": {"mode": "multi", "sort": "none"}},
             "targets": [{"datasource": DS, "expr": expr, "legendFormat": legend,
                          "range": True, "refId": chr(ord("A") + i)}
                         for i, (expr, legend) in enumerate(targets)]}
        self.panels.append(p)
        self.x = 12 - self.x
        if not self.x:
            self.y += 8


def build() -> dict:
    b = Board()
    b.row("Engine")
    b.panel("E2E Request Latency", "End to end request latency (arrival to finish).",
            quantiles("llmserve:e2e_request_latency_seconds"), "s")
    b.panel("Token Throughput", "Prompt tokens prefilled and tokens generated per second.",
            [(f"rate(llmserve:prompt_tokens_total{M}[{RI}])", "Prompt Tokens/Sec"),
             (f"rate(llmserve:generation_tokens_total{M}[{RI}])", "Generation Tokens/Sec")],
            "short")
    b.panel("Time Per Output Token Latency", "(e2e - TTFT) / (output tokens - 1).",
            quantiles("llmserve:time_per_output_token_seconds"), "s")
    b.panel("Scheduler State", "Requests in the running batch and waiting to be scheduled.",
            [(f"llmserve:num_requests_running{M}", "Num Running"),
             (f"llmserve:num_requests_waiting{M}", "Num Waiting")])
    b.panel("Time To First Token Latency", "Arrival to first token.",
            quantiles("llmserve:time_to_first_token_seconds"), "s")
    b.panel("Cache Utilization", "KV cache blocks in use (0..1) and the prefix-cache hit "
            "rate (hit tokens / looked-up tokens).",
            [(f"llmserve:kv_cache_usage_perc{M}", "KV Cache Usage"),
             (f"rate(llmserve:prefix_cache_hits_total{M}[{RI}]) / "
              f"rate(llmserve:prefix_cache_queries_total{M}[{RI}])", "Prefix Cache Hit Rate")],
            "percentunit")
    b.panel("Prompt Tokens From Caches", "Prompt tokens served by the local prefix cache "
            "and loaded from the shared KV store (--kv-store) instead of computed.",
            [(f"rate(llmserve:prefix_cache_hits_total{M}[{RI}])", "Prefix Cache"),
             (f"rate(llmserve:kv_store_hits_total{M}[{RI}])", "KV Store")])
    b.panel("Inter-Token Latency", "Every gap between two output tokens.",
            quantiles("llmserve:inter_token_latency_seconds"), "s")
    b.panel("Finish Reason", "Finished requests per interval by reason (stop, length, "
            "abort).",
            [(f"sum by(finished_reason) (increase(llmserve:request_success_total{M}[{RI}]))",
              "{{finished_reason}}")])
    b.panel("Queue Time", "Arrival to first scheduled.",
            quantiles("llmserve:request_queue_time_seconds"), "s")
    b.panel("Preemptions", "Requests preempted per second (KV cache pressure).",
            [(f"rate(llmserve:num_preemptions_total{M}[{RI}])", "Preemptions/Sec")])
    b.panel("Batch Size", "Requests per engine step (the batch) and the most seen.",
            [(f"histogram_quantile(0.5, sum by(le) (rate(llmserve:iteration_num_requests_bucket"
              f"{{{MLE}}}[{RI}])))", "P50 Batch Size"),
             (f"llmserve:max_batch_size{M}", "Max Batch Size")])
    b.panel("Tokens Per Engine Step", "Tokens scheduled per engine step (prefill + decode).",
            quantiles("llmserve:iteration_tokens_total"))
    b.row("Router")
    b.panel("Routed Requests", "Requests the router sent, per worker.",
            [(f"sum by(worker) (rate(llmserve_router:requests_total[{RI}]))", "{{worker}}")])
    b.panel("Routing Decisions", "Picks by reason (cache_hit, balance, miss, failover, ...).",
            [(f"sum by(reason) (rate(llmserve_router:routing_decisions_total[{RI}]))",
              "{{reason}}")])
    b.panel("Cache-Hit Tokens", "Prompt tokens the router expected cached on its pick.",
            [(f"rate(llmserve_router:cache_hit_tokens_total[{RI}])", "Tokens/Sec")])
    b.panel("Retries and Errors", "Attempts retried before the first byte; router errors.",
            [(f"sum by(worker) (rate(llmserve_router:retries_total[{RI}]))",
              "retry {{worker}}"),
             (f"sum by(reason) (rate(llmserve_router:request_errors_total[{RI}]))",
              "error {{reason}}")])
    b.panel("Worker Health", "1 healthy, 0 not.",
            [("llmserve_router:worker_healthy", "{{worker}}")])
    b.panel("Worker In-Flight", "Router requests outstanding per worker.",
            [("llmserve_router:worker_in_flight", "{{worker}}")])
    b.panel("Shared State (Redis)", "--redis-url: 1 while the replica reaches Redis, 0 while "
            "it routes from its local cache (degraded); failed Redis calls by operation.",
            [("llmserve_router:redis_up", "Redis up"),
             (f"sum by(op) (rate(llmserve_router:redis_errors_total[{RI}]))", "errors {{op}}")])
    b.panel("Tiered Routing", "Requests per alias by the tier that answered; escalations.",
            [(f"sum by(alias, model) (rate(llmserve_router:tier_requests_total[{RI}]))",
              "{{alias}} -> {{model}}"),
             (f"sum by(alias, from_model, to_model) "
              f"(rate(llmserve_router:tier_escalations_total[{RI}]))",
              "escalated {{from_model}} -> {{to_model}}")])
    b.row("Gateway")
    b.panel("Gateway Requests", "Finished requests by HTTP status code.",
            [(f"sum by(code) (rate(llmserve_gateway:requests_total[{RI}]))", "{{code}}")])
    b.panel("Rate-Limit Rejections", "Requests refused by a limit or quota, by limit.",
            [(f"sum by(limit) (rate(llmserve_gateway:rate_limit_rejections_total[{RI}]))",
              "{{limit}}")])
    b.panel("Gateway Upstream Latency", "Request sent to upstream response headers.",
            quantiles("llmserve_gateway:upstream_latency_seconds", sel=""), "s")
    b.panel("Gateway Request Duration", "Arrival at the gateway to response end.",
            quantiles("llmserve_gateway:request_duration_seconds", sel=""), "s")
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "annotations": {"list": []}, "editable": True, "graphTooltip": 1,
        "panels": b.panels, "refresh": "10s", "schemaVersion": 39, "tags": ["llmserve"],
        "time": {"from": "now-30m", "to": "now"}, "timepicker": {},
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "datasource", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0},
            {"name": "model_name", "label": "model", "type": "query", "datasource": DS,
             "query": {"query": "label_values(llmserve:num_requests_running, model_name)",
                       "refId": "model"},
             "definition": "label_values(llmserve:num_requests_running, model_name)",
             "includeAll": True, "multi": True, "refresh": 2, "current": {}, "hide": 0}]},
        "timezone": "", "title": "llmserve", "uid": "llmserve", "version": 1,
    }


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llmserve.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(build(), f, indent=2)
        f.write("\n")
    print(f"wrote {path}")

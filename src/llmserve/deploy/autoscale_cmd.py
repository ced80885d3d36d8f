"""``llmserve autoscale SPEC``: the control loop of a local deployment (started by
``llmserve up`` when ``autoscaling.enabled``), or ``--simulate TRACE`` to replay a
recorded load trace without any process.

Each model of the spec scales on its own: its own :class:`~.autoscaler.Autoscaler`
(its ``replicas.min``/``max``, the deployment's ``autoscaling`` targets) fed only by
its own workers' metrics. Every ``interval_s`` it scrapes each worker's Prometheus
``/metrics``
(``llmserve:num_requests_waiting``, ``llmserve:kv_cache_usage_perc`` and the
``llmserve:time_to_first_token_seconds`` histogram, whose p90 over the interval is
computed from bucket deltas as Prometheus' ``histogram_quantile`` does), asks
:class:`~.autoscaler.Autoscaler`, and applies the decision: scale-up starts a worker,
waits for its ``/health`` and adds it with the router's ``POST /workers``; scale-down
drains the model's newest worker with ``DELETE /workers/{id}`` (no new requests;
removed once its requests finished) and only then stops it. One JSON line per model
and tick goes to stdout (``"model"`` names it).
"""

from __future__ import annotations

import csv
import json
import math
import signal
import time

import httpx

from llmserve.deploy.autoscaler import Autoscaler, Sample, simulate

TTFT = "llmserve:time_to_first_token_seconds"


def parse_metrics(text: str) -> dict:
    """``{"waiting", "running", "kv", "ttft_buckets": {le: cumulative count}}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"waiting": 0.0, "running": 0.0, "kv": 0.0, "ttft_buckets": {}}
    names = {"llmserve:num_requests_waiting": "waiting",
             "llmserve:num_requests_running": "running", "llmserve:kv_cache_usage_perc": "kv"}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names:
                out[names[s.name]] += s.value
            elif s.name == TTFT + "_bucket":
                le = float(s.labels["le"])
                out["ttft_buckets"][le] = out["ttft_buckets"].get(le, 0.0) + s.value
    return out


def histogram_quantile(q: float, prev: dict[float, float], cur: dict[float, float]
                       ) -> float | None:
    """The ``q`` quantile of the observations between two scrapes of cumulative
    buckets ``{upper bound: count}`` (linear inside a bucket; None if none)."""
    bounds = sorted(cur)
    deltas = [max(0.0, cur[b] - prev.get(b, 0.0)) for b in bounds]
    if not bounds or deltas[-1] <= 0:
        return None
    rank = q * deltas[-1]
    lower, below = 0.0, 0.0
    for b, c in zip(bounds, deltas):
        if c >= rank:
            if math.isinf(b):
                return lower
            return lower + (b - lower) * (rank - below) / max(c - below, 1e-12)
        lower, below = b, c
    return lower


def load_trace(path: str) -> list[dict]:
    """A JSON list of rows, or a CSV with a header (t, num_requests_waiting, ...)."""
    with open(path, encoding="utf-8") as f:
        if path.endswith(".csv"):
            return [{k: (float(v) if v not in ("", None) else None) for k, v in row.items()}
                    for row in csv.DictReader(f)]
        rows = json.load(f)
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "t" in r for r in rows):
        raise ValueError(f"{path}: a trace is a list of {{t, num_requests_waiting, ...}} rows")
    return rows


def plot(decisions, trace: list[dict], path: str, title: str) -> None:
    """Raises: ValueError: matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib, or the "
                         "project's test/bench extra)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ts = [d.t for d in decisions]
    ax.step(ts, [d.desired for d in decisions], where="post", label="replicas", color="C0")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("replicas")
    ax2 = ax.twinx()
    rows = sorted(trace, key=lambda r: r["t"])
    ax2.plot([r["t"] for r in rows], [r.get("num_requests_waiting") or 0 for r in rows],
             color="C1", alpha=0.6, label="waiting requests")
    ax2.set_ylabel("waiting requests")
    ax.set_title(title)
    fig.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _simulate(args, spec) -> int:
    trace = load_trace(args.simulate)
    m = spec.models[0]
    if args.model is not None:
        try:
            m = spec.model_named(args.model)
        except KeyError:
            raise ValueError(f"--model {args.model!r}: not in the spec; its models: "
                             f"{[x.name for x in spec.models]}") from None
    decisions = simulate(trace, spec.autoscaling, m.replicas.min, m.replicas.max)
    print(f"{'t':>8s} {'replicas':>8s} {'desired':>8s}  reason")
    for d in decisions:
        print(f"{d.t:8.1f} {d.current:8d} {d.desired:8d}  {d.reason}")
    if args.plot:
        plot(decisions, trace, args.plot, f"{spec.name}/{m.name}: simulated replicas")
    return 0


def run(args) -> int:
    from llmserve.deploy.local import Deployment
    from llmserve.deploy.spec import load_spec

    spec = load_spec(args.spec)
    if args.simulate:
        return _simulate(args, spec)
    dep = Deployment.attach(args.state_dir, spec.name)
    while "ready_s" not in dep.data:  # `up` writes the state last; then it is ours
        time.sleep(0.2)
        dep.reload()

    def on_term(*_):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    cfg = spec.autoscaling
    scalers = {m.name: Autoscaler(cfg, m.replicas.min, m.replicas.max) for m in spec.models}
    prev: dict[str, dict] = {}
    t0 = time.monotonic()
    with httpx.Client(timeout=5) as client:
        while True:
            for name, scaler in scalers.items():
                tick(dep, client, name, scaler, prev, t0)
            if args.once:
                return 0
            time.sleep(cfg.interval_s)


def model_sample(client: httpx.Client, workers, prev: dict[str, dict], t: float) -> Sample:
    """One :class:`Sample` of ``workers`` (one model's): waiting and running summed, KV
    usage averaged, the largest per-worker TTFT p90 since the last scrape (``prev``,
    updated in place, keyed by worker id)."""
    scraped = {}
    for w in workers:
        try:
            scraped[w.id] = parse_metrics(client.get(w.url + "/metrics").text)
        except (httpx.HTTPError, ValueError):
            continue
    p90s = [q for wid, s in scraped.items() if (q := histogram_quantile(
        0.9, prev.get(wid, {}).get("ttft_buckets", {}), s["ttft_buckets"])) is not None]
    prev.update(scraped)
    return Sample(t, len(workers), sum(s["waiting"] for s in scraped.values()),
                  sum(s["kv"] for s in scraped.values()) / max(len(scraped), 1),
                  max(p90s) if p90s else None, sum(s["running"] for s in scraped.values()))


def tick(dep, client: httpx.Client, model: str, scaler: Autoscaler, prev: dict[str, dict],
         t0: float) -> None:
    """Scrape ``model``'s workers, decide, and add or drain that model's workers."""
    workers = [w for w in dep.workers_of(model) if w.url]
    n = len(workers)
    sample = model_sample(client, workers, prev, time.monotonic() - t0)
    scaler.observe(sample)
    d = scaler.decide(sample.t, n)
    print(json.dumps({"t": round(sample.t, 2), "model": model, "replicas": n,
                      "desired": d.desired, "reason": d.reason, "panic": d.panic,
                      "waiting": sample.num_requests_waiting,
                      "running": sample.num_requests_running,
                      "kv": round(sample.kv_cache_usage, 4),
                      "ttft_p90_s": sample.ttft_p90_s}), flush=True)
    for _ in range(d.desired - n):
        rec = dep.add_worker(model)
        print(json.dumps({"event": "added", "model": model, "worker": rec.id,
                          "url": rec.url}), flush=True)
    newest = sorted(workers, key=lambda w: int(w.id.rsplit("-", 1)[-1]), reverse=True)
    for rec in newest[:max(0, n - d.desired)]:
        result = dep.remove_worker(rec)
        print(json.dumps({"event": "removed", "model": model, "worker": rec.id,
                          "stop": result}), flush=True)
    if d.desired != n:
        scaler.applied(time.monotonic() - t0)

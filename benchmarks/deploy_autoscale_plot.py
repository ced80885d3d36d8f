"""Plot an ``llmserve autoscale`` log (one JSON line per tick, as written to
``<state-dir>/<name>/autoscaler.log``): replicas, requests in flight and p90 TTFT
over time.

    python benchmarks/deploy_autoscale_plot.py autoscaler.log docs/deployment/autoscale_burst.png [MODEL]

A multi-model deployment logs one line per model and tick (``"model"``); MODEL picks
one (default: the first one logged).
"""

from __future__ import annotations

import json
import sys


def main(log_path: str, png: str, model: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ticks, events = [], []
    with open(log_path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("{"):
                row = json.loads(line)
                (events if "event" in row else ticks).append(row)
    if model is None:
        model = next((r["model"] for r in ticks if "model" in r), None)
    if model is not None:
        ticks = [r for r in ticks if r.get("model", model) == model]
        events = [e for e in events if e.get("model", model) == model]
    t = [r["t"] for r in ticks]
    fig, (ax, ax3) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    ax.step(t, [r["replicas"] for r in ticks], where="post", color="C0", label="replicas")
    ax.step(t, [r["desired"] for r in ticks], where="post", color="C0", ls=":",
            label="desired")
    ax.set_ylabel("replicas")
    ax.set_ylim(0, max(r["desired"] for r in ticks) + 1)
    ax2 = ax.twinx()
    ax2.plot(t, [r["waiting"] for r in ticks], color="C1", label="waiting")
    ax2.plot(t, [r["running"] for r in ticks], color="C2", label="running")
    ax2.set_ylabel("requests (all workers)")
    fig.legend(loc="upper left", bbox_to_anchor=(0.08, 0.9), fontsize=8)
    pts = [(r["t"], r["ttft_p90_s"]) for r in ticks if r.get("ttft_p90_s") is not None]
    ax3.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color="C3", ms=3)
    ax3.set_ylabel("TTFT p90 (s)")
    ax3.set_xlabel("time since the autoscaler started (s)")
    ax.set_title("llmserve autoscale: a burst of 16 clients on one worker (max_num_seqs 8)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"{png}: {len(ticks)} ticks, events {[e['event'] for e in events]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)

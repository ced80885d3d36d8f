"""Serving metrics from per-request timestamps, with vLLM's definitions.

Per request (seconds; ``t0`` = when the request was sent)::

    t0 ---- first token ---- token 2 ---- ... ---- token n (last)
    |<-TTFT->|<--- ITL --->|<-- ITL -->|           |
    |<------------------------- E2EL --------------------------->|
    TPOT = (E2EL - TTFT) / (n - 1)       (only for n > 1)

ITL collects every gap between consecutive streamed chunks, over all requests.
Throughputs divide by the benchmark's wall time. Goodput counts requests that
meet every SLO given (``ttft``, ``tpot``, ``e2el`` in milliseconds; a request
with n <= 1 has TPOT 0 for this check, as in vLLM). Percentiles use numpy's
linear interpolation. Source: vLLM ``benchmarks/benchmark_serving.py``
(``calculate_metrics``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestResult:
    """One request's outcome. Times in seconds; ``itl`` = gaps after the first chunk."""

    success: bool
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""


@dataclass
class Distribution:
    """mean, median, std and percentiles of one metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[str, float]

    @classmethod
    def of(cls, seconds: list[float], percentiles=DEFAULT_PERCENTILES) -> Distribution:
        ms = np.asarray(seconds if seconds else [0.0], dtype=np.float64) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   {f"p{p:g}": float(np.percentile(ms, p)) for p in percentiles})


@dataclass
class BenchmarkMetrics:
    """The summary ``bench serve`` prints and saves (throughputs per second of wall time)."""

    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution

    def to_dict(self) -> dict:
        """Flat, with vLLM's result keys: ``mean_ttft_ms``, ``p99_itl_ms``, ``request_goodput``..."""
        out = {k: v for k, v in asdict(self).items() if not k.endswith("_ms")}
        for name in ("ttft", "tpot", "itl", "e2el"):
            d: Distribution = getattr(self, f"{name}_ms")
            out.update({f"mean_{name}_ms": d.mean, f"median_{name}_ms": d.median,
                        f"std_{name}_ms": d.std})
            out.update({f"{p}_{name}_ms": v for p, v in d.percentiles.items()})
        return out


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds).

    Raises:
        ValueError: a malformed item, an unknown metric or a negative value.
    """
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {list(GOODPUT_METRICS)}, "
                             f"got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if ms < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms")
        slos[name] = ms / 1000.0
    return slos


def request_tpot(r: RequestResult) -> float | None:
    """``(latency - ttft) / (output_len - 1)`` seconds, or None when ``output_len <= 1``."""
    if r.output_len <= 1:
        return None
    return (r.latency - r.ttft) / (r.output_len - 1)


def calculate_metrics(results: list[RequestResult], duration_s: float,
                      goodput_slos: dict[str, float] | None = None,
                      percentiles=DEFAULT_PERCENTILES) -> BenchmarkMetrics:
    """Summarise per-request results over a benchmark of ``duration_s`` seconds.

    Raises:
        ValueError: a non-positive duration.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    tpots = [t for t in (request_tpot(r) for r in ok) if t is not None]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    goodput = None
    if goodput_slos:
        good = 0
        for r in ok:
            values = {"ttft": r.ttft, "tpot": request_tpot(r) or 0.0, "e2el": r.latency}
            good += all(values[k] <= slo for k, slo in goodput_slos.items())
        goodput = good / duration_s
    return BenchmarkMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input=total_in, total_output=total_out,
        request_throughput=len(ok) / duration_s, request_goodput=goodput,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft_ms=Distribution.of([r.ttft for r in ok], percentiles),
        tpot_ms=Distribution.of(tpots, percentiles),
        itl_ms=Distribution.of([g for r in ok for g in r.itl], percentiles),
        e2el_ms=Distribution.of([r.latency for r in ok], percentiles))


def format_metrics(m: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    """A vLLM-style text table of ``m``."""
    lines = [f"{'=' * 18} {title} {'=' * 18}",
             f"{'Successful requests:':<40}{m.completed:<10}",
             f"{'Failed requests:':<40}{m.failed:<10}",
             f"{'Benchmark duration (s):':<40}{m.duration_s:<10.2f}",
             f"{'Total input tokens:':<40}{m.total_input:<10}",
             f"{'Total generated tokens:':<40}{m.total_output:<10}",
             f"{'Request throughput (req/s):':<40}{m.request_throughput:<10.2f}"]
    if m.request_goodput is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{m.request_goodput:<10.2f}")
    lines += [f"{'Output token throughput (tok/s):':<40}{m.output_throughput:<10.2f}",
              f"{'Total token throughput (tok/s):':<40}{m.total_token_throughput:<10.2f}"]
    for name, label in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token "
                        "(excl. 1st token)"), ("itl_ms", "Inter-token Latency"),
                        ("e2el_ms", "End-to-end Latency")):
        d: Distribution = getattr(m, name)
        short = name.split("_")[0].upper()
        lines.append(f"{'-' * 15}{label}{'-' * 15}")
        lines.append(f"{f'Mean {short} (ms):':<40}{d.mean:<10.2f}")
        lines.append(f"{f'Median {short} (ms):':<40}{d.median:<10.2f}")
        lines += [f"{f'{p.upper()} {short} (ms):':<40}{v:<10.2f}" for p, v in d.percentiles.items()]
    lines.append("=" * 56)
    return "\n".join(lines)

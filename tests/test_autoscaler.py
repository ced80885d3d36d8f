"""The autoscaler's decisions as pure functions, against scenarios computed by hand
(the arithmetic is in the comments), the histogram p90, and the simulation CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmserve.deploy.autoscale_cmd import histogram_quantile, parse_metrics
from llmserve.deploy.autoscaler import Autoscaler, Sample, simulate
from llmserve.deploy.spec import AutoscalingSpec

WAITING_ONLY = AutoscalingSpec(
    enabled=True, target_num_requests_waiting=5, target_kv_cache_usage=None,
    stable_window_s=10, panic_window_s=2, panic_threshold=2, max_scale_up_rate=2,
    max_scale_down_rate=2, scale_up_cooldown_s=0, scale_down_cooldown_s=5, interval_s=1)


def burst_trace() -> list[dict]:
    # 0 waiting for t=0..9, 20 waiting (demand 20/5 = 4 replicas) for t=10..19, then 0
    return [{"t": t, "num_requests_waiting": 20 if 10 <= t < 20 else 0} for t in range(41)]


def test_burst_replica_curve_matches_hand_computation():
    got = [d.desired for d in simulate(burst_trace(), WAITING_ONLY, 1, 4)]
    # t=10: panic window (8,10] = {t9: 0, t10: 4} -> mean 2 >= 2 x 1 replica: panic; 2
    # t=11: panic window {4, 4} -> 4 >= 2 x 2: panic again (until 21); rate cap 2x2 = 4
    # t=12..20: in panic, never down: 4
    # t=21: panic over; stable window (11,21] = eight 4s + two 0s = 3.2 -> 4
    # t=22: (12,22] = seven 4s / 10 = 2.8 -> 3 (last change t=11, cooldown 5 passed)
    # t=23: 2.4 -> 3 (no change); t=24..26: 2.0, 1.6, 1.2 -> 2 but cooldown since t=22
    # t=27: 0.8 -> 1, 27 - 22 = 5 >= cooldown; down-rate floor(3 / 2) = 1 allows it
    want = [1] * 10 + [2] + [4] * 11 + [3] * 5 + [1] * 14
    assert got == want


def test_reasons_and_panic_flags():
    ds = simulate(burst_trace(), WAITING_ONLY, 1, 4)
    assert ds[10].panic and ds[10].reason == "panic window"
    assert ds[20].panic and not ds[21].panic
    assert ds[24].reason == "scale-down cooldown" and ds[24].desired == 3
    assert ds[27].reason == "stable window" and ds[27].desired == 1


def test_rates_bounds_and_startup_delay():
    # demand 40/5 = 8 at once: panic; up-rate caps 1 -> 2 -> 4 -> 8, then max 6
    trace = [{"t": t, "num_requests_waiting": 40 if t >= 1 else 0} for t in range(6)]
    assert [d.desired for d in simulate(trace, WAITING_ONLY, 1, 6)] == [1, 2, 4, 6, 6, 6]
    # new replicas take 2 s to start: the decision counts them as soon as they are asked
    # for (no double scale-up while they load)
    got = simulate(trace, WAITING_ONLY, 1, 6, startup_s=2)
    assert [d.desired for d in got] == [1, 2, 4, 6, 6, 6]


def test_kv_and_ttft_targets():
    cfg = AutoscalingSpec(enabled=True, target_num_requests_waiting=5,
                          target_kv_cache_usage=0.8, target_ttft_p90_s=1.0,
                          stable_window_s=4, panic_window_s=1, scale_down_cooldown_s=0)
    a = Autoscaler(cfg, 1, 8)
    # 2 replicas at 90% KV: 2 x 0.9 / 0.8 = 2.25 -> 3; waiting 5/5 = 1; no TTFT sample
    a.observe(Sample(0.0, 2, num_requests_waiting=5, kv_cache_usage=0.9))
    assert a.decide(0.0, 2).desired == 3
    # TTFT p90 2.5 s at 3 replicas vs target 1 s: 3 x 2.5 = 7.5 -> 8 (panic: 8 >= 2 x 3)
    b = Autoscaler(cfg, 1, 8)
    b.observe(Sample(0.0, 3, kv_cache_usage=0.1, ttft_p90_s=2.5))
    d = b.decide(0.0, 3)
    assert (d.desired, d.panic) == (6, True)  # up-rate 2: ceil(3 x 2) = 6 this step


def test_scale_to_zero_and_wake_up():
    cfg = AutoscalingSpec(enabled=True, target_num_requests_waiting=5,
                          target_kv_cache_usage=None, stable_window_s=2, panic_window_s=1,
                          scale_down_cooldown_s=0, scale_to_zero=True)
    a = Autoscaler(cfg, 0, 2)
    a.observe(Sample(0.0, 1))
    assert a.decide(0.0, 1).desired == 0  # idle: floor(1 / 2) = 0 allowed
    a.observe(Sample(5.0, 0, num_requests_waiting=1))
    assert a.decide(5.0, 0).desired == 1  # a request waits at zero replicas
    with pytest.raises(ValueError, match="scale_to_zero"):
        Autoscaler(WAITING_ONLY, 0, 2)
    assert Autoscaler(WAITING_ONLY, 1, 2).decide(0.0, 1).reason == "no metrics"


def test_histogram_p90_and_metrics_parse():
    text = "\n".join([
        "# TYPE llmserve:num_requests_waiting gauge",
        'llmserve:num_requests_waiting{model_name="m"} 3.0',
        "# TYPE llmserve:kv_cache_usage_perc gauge",
        'llmserve:kv_cache_usage_perc{model_name="m"} 0.25',
        "# TYPE llmserve:time_to_first_token_seconds histogram",
        'llmserve:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 2.0',
        'llmserve:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 8.0',
        'llmserve:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 10.0',
        'llmserve:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 10.0',
        'llmserve:time_to_first_token_seconds_count{model_name="m"} 10.0',
        'llmserve:time_to_first_token_seconds_sum{model_name="m"} 3.0', ""])
    m = parse_metrics(text)
    assert (m["waiting"], m["kv"]) == (3.0, 0.25)
    # rank 0.9 x 10 = 9 falls in (0.5, 1.0] holding counts 8..10: 0.5 + 0.5 x 1/2
    assert histogram_quantile(0.9, {}, m["ttft_buckets"]) == pytest.approx(0.75)
    # between two scrapes only the new observations count: 2 new, both <= 0.1
    later = {**m["ttft_buckets"], 0.1: 4.0, 0.5: 10.0, 1.0: 12.0, float("inf"): 12.0}
    assert histogram_quantile(0.9, m["ttft_buckets"], later) == pytest.approx(0.1 * 1.8 / 2)
    assert histogram_quantile(0.9, later, later) is None


def test_simulate_cli_prints_curve_and_plots(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(burst_trace()))
    spec = tmp_path / "llmserve.yaml"
    spec.write_text("name: sim\nmodels: [{name: m, replicas: {min: 1, max: 4}}]\n"
                    "autoscaling: {enabled: true, target_kv_cache_usage: null, "
                    "stable_window_s: 10, panic_window_s: 2, scale_down_cooldown_s: 5}\n")
    png = tmp_path / "curve.png"
    out = subprocess.run([sys.executable, "-m", "llmserve.entrypoints.cli", "autoscale",
                          str(spec), "--simulate", str(trace), "--plot", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert [int(r[2]) for r in rows] == [1] * 10 + [2] + [4] * 11 + [3] * 5 + [1] * 14
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_concurrency_target_and_cooldown_from_completion():
    cfg = AutoscalingSpec(enabled=True, target_num_requests_waiting=None,
                          target_kv_cache_usage=None, target_concurrency=6,
                          stable_window_s=6, panic_window_s=2, scale_down_cooldown_s=4)
    a = Autoscaler(cfg, 1, 2)
    a.observe(Sample(0.0, 1, num_requests_waiting=8, num_requests_running=8))
    d = a.decide(0.0, 1)  # (8 + 8) / 6 = 2.67 -> 3 >= 2 x 1: panic; max 2
    assert (d.desired, d.panic) == (2, True)
    a.applied(30.0)  # the new worker took 30 s to load: cooldowns count from here
    a.observe(Sample(31.0, 2, num_requests_running=1))
    d = a.decide(31.0, 2)  # window (25, 31] = {1/6} -> 1, but 31 - 30 < 4
    assert (d.desired, d.reason) == (2, "scale-down cooldown")
    a.observe(Sample(34.5, 2, num_requests_running=1))
    assert a.decide(34.5, 2).desired == 1
    # while loaded it does not flap: 2 replicas with 16 in flight ask for 3 (max 2)
    b = Autoscaler(cfg, 1, 2)
    for t in range(10):
        b.observe(Sample(float(t), 2, num_requests_running=16))
        assert b.decide(float(t), 2).desired == 2

"""Data parallelism: ``llmserve serve --data-parallel-size 2``, real processes on loopback.

The front (the router's cache-aware policy and proxy, in the serve process) spreads
concurrent requests over both replicas by load, sends a long shared prefix to the one
replica that holds it (its own ``llmserve:prefix_cache_hits_total``, labelled
``data_parallel_rank`` on the front's /metrics, goes up; the other's does not), and the
greedy text equals the single engine's (``llm_fp32``, the dp=1 oracle). A replica that
dies stops the server with a message naming it and a non-zero exit.
"""

from __future__ import annotations

import re
import signal
import threading

import pytest

from llmserve import SamplingParams
from tests.test_server import MODEL, start_server, stop_server

httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.model

MAX_TOKENS = 10
SHORT = ["The capital of France is", "def add(a, b):", "Water boils at", "1, 2, 3, 4,"]
PREFIX = ("You are a careful assistant. Answer in one short sentence, plainly, without "
          "lists, and never repeat the question. The topic today is the history of the "
          "printing press and how it changed the spread of ideas in Europe. ")
SHARED = [PREFIX + q for q in ("Who built it?", "When was it built?", "Why did it matter?")]


@pytest.fixture(scope="module")
def dp2():
    server = start_server("--data-parallel-size", "2", "--kv-cache-memory", "64MiB")
    yield server
    stop_server(server)


def _complete(url: str, prompt: str) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def _metric(text: str, name: str, rank: int) -> float:
    m = re.search(rf'^{re.escape(name)}\{{data_parallel_rank="{rank}"[^}}]*\}} (\S+)', text, re.M)
    assert m, f"{name} for replica {rank} not in /metrics"
    return float(m.group(1))


def test_dp2_balances_places_prefixes_and_matches_dp1(dp2, llm_fp32):
    from prometheus_client.parser import text_string_to_metric_families

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected = {o.prompt: o.outputs[0].text
                for o in llm_fp32.generate(SHORT + SHARED, params, use_tqdm=False)}
    # concurrent distinct short prompts (no full block to match): least-loaded placement
    answers: dict[str, httpx.Response] = {}
    threads = [threading.Thread(target=lambda p=p: answers.__setitem__(p, _complete(dp2.url, p)))
               for p in SHORT]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    workers = {r.headers["x-llmserve-worker"] for r in answers.values()}
    assert workers == {"dp0", "dp1"}, "both replicas serve"
    before = httpx.get(dp2.url + "/metrics", timeout=30).text
    # a long shared prefix, one request after another: all on the replica that has it
    shared = [_complete(dp2.url, p) for p in SHARED]
    placed = {r.headers["x-llmserve-worker"] for r in shared}
    assert len(placed) == 1, placed
    # (a "miss" is possible when a digest asked mid-prefill replaced the router's
    # assumption; the least-loaded tie-break then picks the same replica)
    assert "cache_hit" in [r.headers["x-llmserve-route-reason"] for r in shared[1:]]
    after = httpx.get(dp2.url + "/metrics", timeout=30).text
    list(text_string_to_metric_families(after))  # the merged page parses
    hit = int(placed.pop()[2:])
    hits = "llmserve:prefix_cache_hits_total"
    assert _metric(after, hits, hit) - _metric(before, hits, hit) >= 2 * 16  # >= a block each
    assert _metric(after, hits, 1 - hit) == _metric(before, hits, 1 - hit)
    got = {p: r.json()["choices"][0]["text"] for p, r in answers.items()}
    got |= {p: r.json()["choices"][0]["text"] for p, r in zip(SHARED, shared, strict=True)}
    assert got == expected, "greedy text at dp=2 equals the single engine's"


def test_dead_replica_stops_the_server_naming_it(dp2):
    m = re.search(r"\[dp1\] INFO: +Started server process \[(\d+)\]", dp2.log())
    assert m, dp2.log()[-2000:]
    import os

    os.kill(int(m.group(1)), signal.SIGKILL)
    assert dp2.proc.wait(timeout=120) == 1
    assert re.search(r"llmserve serve: error: data-parallel replica 1 \(pid \d+\) was killed "
                     r"by SIGKILL", dp2.log()), dp2.log()[-3000:]


def test_merge_metrics_labels_every_replica_sample_once_per_family():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from llmserve.entrypoints.openai.data_parallel import merge_metrics, replica_command

    def page(hits: float) -> str:  # what an engine's /metrics writes (prometheus_client)
        r = CollectorRegistry()
        Counter("llmserve:prefix_cache_hits", "Prompt tokens found.", ["model_name"],
                registry=r).labels("m").inc(hits)
        Histogram("llmserve:e2e_request_latency_seconds", "E2E.", ["model_name"],
                  buckets=(1.0,), registry=r).labels("m").observe(0.5)
        return generate_latest(r).decode()
    merged = merge_metrics({0: page(3.0), 1: page(48.0)})
    assert merged.count("# TYPE llmserve:prefix_cache_hits_total counter") == 1
    fams = {f.name: f for f in text_string_to_metric_families(merged)}
    hits = {s.labels["data_parallel_rank"]: s.value
            for s in fams["llmserve:prefix_cache_hits"].samples if s.name.endswith("_total")}
    assert hits == {"0": 3.0, "1": 48.0}
    assert {s.labels["data_parallel_rank"] for s in
            fams["llmserve:e2e_request_latency_seconds"].samples} == {"0", "1"}
    cmd = replica_command(["serve", "--port", "9000", "--data-parallel-size", "2"])
    assert cmd[-8:] == ["--data-parallel-size", "1", "--host", "127.0.0.1", "--port", "0",
                        "--api-key", ""]

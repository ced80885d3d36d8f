"""Two ``llmserve router --redis-url`` replicas on one real ``redis-server``, in front
of two real ``llmserve serve`` workers (the default model) on loopback.

What one replica learns or decides, the other sees: membership changes, the blocks
it assumed cached on a worker (so a long prefix sent via A then via B lands on one
worker, checked by the workers' own ``prefix_cache_hits_total``), sessions, the
a worker found dead (the shared round-robin counter: test_router_redis_state.py). The replicas run with a long health
interval so what B knows comes from Redis, not from its own checks. Redis killed
mid-run: both replicas keep serving from their caches and say ``degraded``. The
worker-kill test kills worker 1, so it runs last. No assertion depends on timing
(deadlines only bound waits for things that must happen).
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.test_router import (
    CLI,
    CLIENT_TIMEOUT,
    DEFAULT_MODEL,
    PREFIX,
    Proc,
    counter,
    tier_workers,
    worker_urls,
)

httpx = pytest.importorskip("httpx")
pytest.importorskip("redis")

pytestmark = pytest.mark.model

SLOW_HEALTH = "120"  # seconds: no health round between a replica's start and its checks


@pytest.fixture(scope="module")
def workers():
    yield from tier_workers("128MiB")


@pytest.fixture(scope="module")
def redis_url():
    from tests.gateway_procs import start_redis

    proc = start_redis()
    try:
        yield proc.url
    finally:
        proc.stop()


def replica(redis_url: str, prefix: str, *extra: str, workers=()) -> Proc:
    cmd = CLI + ["router", "--port", "0", "--health-interval", SLOW_HEALTH, "--redis-url",
                 redis_url, "--redis-key-prefix", prefix, "--redis-sync-interval", "0.1",
                 "--redis-timeout", "5"]  # no false "degraded" on a busy machine
    for w in workers:
        cmd += ["--worker", w.url]
    r = Proc(cmd + list(extra), r"router: listening on (http://127\.0\.0\.1:\d+)")
    r.wait_ready(time.monotonic() + 180)  # a bound for a busy machine, not a timing check
    return r


def wait_for(what: str, cond, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def post(router: Proc, body: dict, **headers) -> httpx.Response:
    r = httpx.post(router.url + "/v1/completions", timeout=CLIENT_TIMEOUT, headers=headers,
                   json={"max_tokens": 2, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r


def routed(r: httpx.Response) -> tuple[str, str]:
    return r.headers["x-llmserve-worker"], r.headers["x-llmserve-route-reason"]


def test_replicas_share_membership_cache_view_and_sessions(workers, redis_url):
    w0, w1 = workers
    a = replica(redis_url, "t1:", workers=[w0])
    b = replica(redis_url, "t1:")  # no --worker: it learns them from Redis
    try:
        assert worker_urls(b) == {"w0": w0.url}
        r = httpx.post(a.url + "/workers", json={"url": w1.url}, timeout=30)
        assert r.status_code == 201 and r.json()["id"] == "w1", r.text
        assert httpx.post(b.url + "/workers", json={"url": w1.url}, timeout=30
                          ).status_code == 409  # one membership: B knows it is there
        wait_for("B to see w1", lambda: worker_urls(b) == {"w0": w0.url, "w1": w1.url})
        wait_for("B to know w1's models", lambda: [
            w["models"] for w in httpx.get(b.url + "/workers", timeout=10).json()["workers"]
            if w["id"] == "w1"] == [[DEFAULT_MODEL, "large"]])

        # A routes a long prefix to w1 (the only worker serving "large"); via B the same
        # prefix under the model both serve goes to w1 as a cache hit: B's view of w1
        # is what A recorded in Redis (B polls no digest in between). Alone, B would
        # send this miss to the least-loaded, first-by-id worker, w0.
        prefix = PREFIX.replace("shipping", "ferry")
        hits0 = {w.url: counter(w.url, "llmserve:prefix_cache_hits_total") for w in workers}
        first = post(a, {"model": "large", "prompt": prefix + "Question: a 4 kg parcel?"})
        assert routed(first) == ("w1", "miss")
        second = post(b, {"model": DEFAULT_MODEL, "prompt": prefix + "Question: 7 kg?"})
        assert routed(second) == ("w1", "cache_hit")
        details = second.json()["usage"].get("prompt_tokens_details") or {}
        assert details.get("cached_tokens", 0) >= 300, details
        hits = {w.url: counter(w.url, "llmserve:prefix_cache_hits_total") - hits0[w.url]
                for w in workers}
        assert hits[w1.url] >= 300 and hits[w0.url] == 0, hits

        # a session started via A sticks via B
        s = {"x-session-id": "alice"}
        assert routed(post(a, {"model": "large", "prompt": "Hi"}, **s))[0] == "w1"
        assert routed(post(b, {"model": DEFAULT_MODEL, "prompt": "Hello"}, **s)) == (
            "w1", "session")
        assert counter(b.url, "llmserve_router:redis_up") == 1

        d = httpx.delete(b.url + "/workers/w1", timeout=10)  # idle: removed at once
        assert d.status_code == 200 and d.json()["removed"] is True, d.text
        wait_for("A to drop w1", lambda: list(worker_urls(a)) == ["w0"])
        assert {routed(post(a, {"prompt": "Hi", "max_tokens": 1}))[0]
                for _ in range(2)} == {"w0"}
    finally:
        a.stop()
        b.stop()


def test_redis_down_mid_run_replicas_serve_from_cache(workers):
    from tests.gateway_procs import start_redis

    doomed = start_redis()
    a = replica(doomed.url, "t2:", workers=workers)
    b = replica(doomed.url, "t2:", workers=workers)
    try:
        assert httpx.get(a.url + "/health", timeout=10).json()["status"] == "ok"
        post(a, {"prompt": "Question: 3 kg?", "max_tokens": 1})
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait(timeout=30)
        for i, r in enumerate((a, b, a, b)):
            out = post(r, {"prompt": f"Question: {i + 5} kg?", "max_tokens": 1})
            assert len(out.json()["choices"]) == 1
        for r in (a, b):
            h = httpx.get(r.url + "/health", timeout=10)
            assert h.status_code == 200 and h.json()["status"] == "degraded", h.text
            assert counter(r.url, "llmserve_router:redis_up") == 0
            assert counter(r.url, "llmserve_router:redis_errors_total") >= 1
        bad = httpx.post(a.url + "/workers", json={"url": "http://127.0.0.1:9"}, timeout=10)
        assert bad.status_code == 503 and "Redis" in bad.json()["error"]["message"]
        assert "unreachable" in a.log()  # one logged warning
    finally:
        a.stop()
        b.stop()
        doomed.stop()


def test_worker_killed_is_out_for_both_replicas(workers, redis_url):  # last: kills w1
    w0, w1 = workers
    a = replica(redis_url, "t3:", workers=workers)
    b = replica(redis_url, "t3:", workers=workers)
    try:
        w1.proc.send_signal(signal.SIGKILL)
        w1.proc.wait(timeout=30)
        # via A: "large" is served by w1 only; the refused connection marks it down
        r = httpx.post(a.url + "/v1/completions", timeout=CLIENT_TIMEOUT,
                       json={"model": "large", "prompt": "Hi", "max_tokens": 1})
        assert r.status_code in (502, 503) and "error" in r.json(), r.text

        def b_sees_it_down():
            state = {w["id"]: w for w in httpx.get(b.url + "/workers", timeout=10)
                     .json()["workers"]}
            return state["w1"]["healthy"] is False and state["w0"]["healthy"] is True

        wait_for("B to see w1 down", b_sees_it_down)  # B ran no health check since
        r = httpx.post(b.url + "/v1/completions", timeout=CLIENT_TIMEOUT,
                       json={"model": "large", "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 503 and "error" in r.json(), r.text  # not tried at all
        assert counter(b.url, "llmserve_router:retries_total") == 0
        assert {routed(post(b, {"prompt": f"Hi {i}", "max_tokens": 1}))[0]
                for i in range(3)} == {"w0"}
    finally:
        a.stop()
        b.stop()

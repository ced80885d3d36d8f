"""``llmserve router`` as a real process in front of two real ``llmserve serve``
workers (the default model, float32) on loopback.

The workers start once for the module; each test starts its own router (no torch:
it starts in about a second). Routing is checked against the workers' own
counters (``llmserve:prefix_cache_hits_total``, ``request_success_total``), not
only the router's. The SIGKILL test kills worker 1, so it runs last. Every client
call has a timeout; no assertion depends on how fast anything runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

pytestmark = pytest.mark.model

START_TIMEOUT = 300.0
CLIENT_TIMEOUT = 120.0
# about 330 tokens shared by every prompt of a test (20 full blocks of 16)
PREFIX = ("You are a careful assistant for a shipping company. " +
          " ".join(f"Rule {i}: parcels over {i + 2} kilograms need form {100 + i}."
                   for i in range(24)) + "\n")


class Proc:
    def __init__(self, cmd: list[str], pattern: str) -> None:
        fd, self.log_path = tempfile.mkstemp(prefix="llmserve-router-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.pattern = pattern
        self.url = ""

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_ready(self, deadline: float) -> None:
        while True:
            if not self.url:
                m = re.search(self.pattern, self.log())
                self.url = m.group(1) if m else ""
            if self.url:
                try:
                    if httpx.get(self.url + "/health", timeout=10).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"{self.proc.args} did not become healthy:\n{self.log()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


CLI = [sys.executable, "-m", "llmserve.entrypoints.cli"]
DEFAULT_MODEL = "smollm2-135m-instruct"


def tier_workers(kv_cache_memory: str):
    """Two default-model workers; worker 0 also answers as "small", worker 1 as "large"
    (a model only one of them serves: the tiered-routing tests)."""
    procs = [Proc(CLI + ["serve", "--port", "0", "--dtype", "float32", "--kv-cache-memory",
                         kv_cache_memory, "--disable-uvicorn-access-log", "--served-model-name",
                         DEFAULT_MODEL, tier],
                  r"listening on (http://127\.0\.0\.1:\d+)") for tier in ("small", "large")]
    try:
        deadline = time.monotonic() + START_TIMEOUT
        for p in procs:
            p.wait_ready(deadline)
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def workers():
    yield from tier_workers("256MiB")


def start_router(urls: list[str], *extra: str) -> Proc:
    cmd = CLI + ["router", "--port", "0", "--health-interval", "0.5"]
    for u in urls:
        cmd += ["--worker", u]
    r = Proc(cmd + list(extra), r"router: listening on (http://127\.0\.0\.1:\d+)")
    r.wait_ready(time.monotonic() + 60)
    return r


def counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def worker_urls(router: Proc) -> dict[str, str]:
    return {w["id"]: w["url"] for w in httpx.get(router.url + "/workers", timeout=10)
            .json()["workers"]}


def complete(router: Proc, prompt: str, max_tokens: int = 4, **headers) -> httpx.Response:
    r = httpx.post(router.url + "/v1/completions", timeout=CLIENT_TIMEOUT, headers=headers,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


async def stream_one(client, url: str, prompt: str, max_tokens: int) -> dict:
    """One streaming completion; what came back, parsed."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        raw = (await r.aread()).decode()
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    return {"status": r.status_code, "worker": r.headers.get("x-llmserve-worker"),
            "reason": r.headers.get("x-llmserve-route-reason"), "events": events,
            "raw": raw}


def test_shared_prefix_lands_on_worker_that_computed_it(workers):
    router = start_router([w.url for w in workers])
    try:
        ids = worker_urls(router)
        hits0 = {wid: counter(u, "llmserve:prefix_cache_hits_total") for wid, u in ids.items()}
        resps = [complete(router, PREFIX + f"Question {i}: what form does a {i + 3} kg "
                          "parcel need?") for i in range(4)]
        chosen = {r.headers["x-llmserve-worker"] for r in resps}
        assert len(chosen) == 1, chosen
        home = chosen.pop()
        assert [r.headers["x-llmserve-route-reason"] for r in resps] == \
            ["miss", "cache_hit", "cache_hit", "cache_hit"]
        cached = [r.json()["usage"].get("prompt_tokens_details", {}) or {} for r in resps]
        assert all(c.get("cached_tokens", 0) >= 300 for c in cached[1:]), cached
        hits = {wid: counter(u, "llmserve:prefix_cache_hits_total") - hits0[wid]
                for wid, u in ids.items()}
        other = next(w for w in ids if w != home)
        assert hits[home] >= 3 * 300 and hits[other] == 0, hits
        print(f"[prefix] home={home} prefix_cache_hits delta={hits} "
              f"cached_tokens={[c.get('cached_tokens') for c in cached]}")
        assert counter(router.url, "llmserve_router:routing_decisions_total") == 4
        assert counter(router.url, "llmserve_router:cache_hit_tokens_total") >= 3 * 300
    finally:
        router.stop()


async def _burst(url: str, n: int, tag: str) -> list[dict]:
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client:
        return await asyncio.gather(*(stream_one(
            client, url, PREFIX + f"{tag} question {i}: summarize rule {i}.", 6)
            for i in range(n)))


def test_imbalance_past_threshold_spreads(workers):
    urls = [w.url for w in workers]
    router = start_router(urls)  # default thresholds: abs 32, rel 1.1
    try:
        results = asyncio.run(_burst(router.url, 4, "default"))
        assert all(r["status"] == 200 and r["events"][-1] == "[DONE]" for r in results)
        assert len({r["worker"] for r in results}) == 1  # 4 in flight: within balance
    finally:
        router.stop()
    router = start_router(urls, "--balance-abs-threshold", "1")
    try:
        results = asyncio.run(_burst(router.url, 4, "tight"))
        assert all(r["status"] == 200 and r["events"][-1] == "[DONE]" for r in results)
        by_worker = {w: sum(r["worker"] == w for r in results) for w in ("w0", "w1")}
        assert by_worker["w0"] >= 1 and by_worker["w1"] >= 1, by_worker
        assert "balance" in {r["reason"] for r in results}
        print(f"[balance] abs=1: per worker {by_worker}, "
              f"reasons {[r['reason'] for r in results]}")
        text = httpx.get(router.url + "/metrics", timeout=10).text
        assert re.search(r'routing_decisions_total\{reason="balance"\} [1-9]', text), text
    finally:
        router.stop()


def test_workers_join_and_drain(workers):
    a, b = (w.url for w in workers)
    router = start_router([a], "--policy", "round_robin")
    try:
        r = httpx.post(router.url + "/workers", json={"url": b}, timeout=30)
        assert r.status_code == 201 and r.json()["healthy"] is True, r.text
        new_id = r.json()["id"]
        assert httpx.post(router.url + "/workers", json={"url": b}, timeout=30
                          ).status_code == 409
        bad = httpx.post(router.url + "/workers", json={"url": "nohost"}, timeout=30)
        assert bad.status_code == 400 and "error" in bad.json()
        assert len(worker_urls(router)) == 2

        async def scenario():
            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client:
                body = {"prompt": "Count from one to twenty:", "max_tokens": 16,
                        "temperature": 0, "stream": True}
                first = await client.post(router.url + "/v1/completions", json={
                    "prompt": "Hi", "max_tokens": 1})  # round robin: next one is new_id
                assert first.headers["x-llmserve-worker"] == "w0"
                # round robin: find a stream on the new worker
                for _ in range(2):
                    async with client.stream("POST", router.url + "/v1/completions",
                                             json=body) as s:
                        if s.headers["x-llmserve-worker"] != new_id:
                            await s.aread()
                            continue
                        chunks = s.aiter_text()
                        text = await chunks.__anext__()
                        d = await client.delete(f"{router.url}/workers/{new_id}")
                        assert d.status_code == 200 and d.json()["draining"] is True
                        assert d.json()["removed"] is False  # one request in flight
                        other = await client.post(router.url + "/v1/completions", json={
                            "prompt": "Hi", "max_tokens": 2})
                        assert other.headers["x-llmserve-worker"] != new_id
                        async for c in chunks:
                            text += c
                        return text
                raise AssertionError("round robin never chose the new worker")

        text = asyncio.run(scenario())
        assert text.rstrip().endswith("data: [DONE]")  # the drained stream finished
        assert list(worker_urls(router)) == ["w0"]  # removed once idle
        assert httpx.delete(router.url + "/workers/nope", timeout=10).status_code == 404
    finally:
        router.stop()


def test_worker_digest_tells_the_router_what_it_holds(workers):
    """A prefix computed on worker 1 without the router (so the router assumed
    nothing) is routed there as a cache hit once worker 1's ``/kv_cache/digest`` says
    it holds those blocks; the digest's hashes are the router's own for the prompt."""
    import base64

    from llmserve.router.prefix import prompt_block_hashes

    router = start_router([w.url for w in workers])
    try:
        b = workers[1].url
        wid = next(i for i, u in worker_urls(router).items() if u == b)
        prefix = PREFIX.replace("shipping", "railway")  # not cached anywhere yet
        r = httpx.post(b + "/v1/completions", timeout=CLIENT_TIMEOUT,
                       json={"prompt": prefix + "Question: a 9 kg parcel?", "max_tokens": 1})
        assert r.status_code == 200, r.text
        ids = httpx.post(b + "/tokenize", json={"prompt": prefix}, timeout=30).json()["tokens"]
        d = httpx.get(b + "/kv_cache/digest", timeout=10).json()
        raw = base64.b64decode(d["hashes"])
        held = {raw[i:i + 32] for i in range(0, len(raw), 32)}
        mine = prompt_block_hashes(ids, d["block_size"])
        assert len(mine) >= 16 and set(mine[:-1]) <= held  # (the prefix's last block
        # may be tokenized differently when the question follows it)
        assert httpx.get(b + "/kv_cache/digest", params={"if_version": d["version"]},
                         timeout=10).status_code == 304
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the router polls digests with health checks
            w = next(w for w in httpx.get(router.url + "/workers", timeout=10).json()
                     ["workers"] if w["id"] == wid)
            if (w["kv_digest_version"] or -1) >= d["version"]:
                break
            time.sleep(0.2)
        hits0 = counter(b, "llmserve:prefix_cache_hits_total")
        r = complete(router, prefix + "Question: what about 12 kg?")
        assert (r.headers["x-llmserve-worker"], r.headers["x-llmserve-route-reason"]) == (
            wid, "cache_hit")
        assert counter(b, "llmserve:prefix_cache_hits_total") - hits0 >= 16 * 15
    finally:
        router.stop()


def test_worker_registers_itself_and_leaves_on_sigterm(workers):
    router = start_router([workers[0].url], "--policy", "round_robin")
    extra = Proc(CLI + ["serve", "--port", "0", "--dtype", "float32", "--kv-cache-memory",
                        "64MiB", "--disable-uvicorn-access-log", "--register-with",
                        router.url], r"listening on (http://127\.0\.0\.1:\d+)")
    try:
        extra.wait_ready(time.monotonic() + START_TIMEOUT)
        deadline = time.monotonic() + 60
        while extra.url not in worker_urls(router).values() and time.monotonic() < deadline:
            time.sleep(0.2)
        wid = next(i for i, u in worker_urls(router).items() if u == extra.url)
        seen = {complete(router, f"Hi {i}", 1).headers["x-llmserve-worker"] for i in range(4)}
        assert wid in seen  # round robin over both
        extra.stop()  # SIGTERM: it leaves the router (drained, then removed) first
        assert extra.proc.returncode == 0
        assert "left router" in extra.log() and wid not in worker_urls(router)
        seen = {complete(router, f"Hi {i}", 1).headers["x-llmserve-worker"] for i in range(3)}
        assert seen == {"w0"}
    finally:
        extra.stop()
        router.stop()


TIERS = {"workers": [], "tiers": {
    "auto": {"levels": [{"model": "small", "max_score": 0.35}, {"model": "large"}]},
    "auto-esc": {"escalate_on": ["length"],
                 "levels": [{"model": "small", "max_score": 0.35}, {"model": "large"}]}}}
CODING_TASK = ("Implement a Python class LRUCache with get and put in O(1), then write unit "
               "tests for it. Explain step by step the design and compare the trade-offs "
               "of an OrderedDict against a dict plus a doubly linked list:\n```python\n"
               "class LRUCache:\n    def __init__(self, capacity: int):\n        pass\n"
               "```\n") * 3


def test_tiered_routing_small_and_large_model(workers, tmp_path):
    """``model: auto`` resolves to the small or the large tier by complexity; the tier's
    own worker answers (checked by the workers' own request counters); escalation on
    ``length`` moves a non-streamed request up, never a streamed one."""
    cfg = tmp_path / "router.yaml"
    cfg.write_text(json.dumps(TIERS))  # JSON is YAML
    router = start_router([w.url for w in workers], "--config", str(cfg))
    try:
        ids = worker_urls(router)
        by_model = {"small": "w0", "large": "w1"}
        assert [w["models"] for w in httpx.get(router.url + "/workers", timeout=10)
                .json()["workers"]] == [[DEFAULT_MODEL, "small"], [DEFAULT_MODEL, "large"]]
        listed = {m["id"] for m in httpx.get(router.url + "/v1/models", timeout=10)
                  .json()["data"]}
        assert listed == {DEFAULT_MODEL, "small", "large", "auto", "auto-esc"}

        def ask(model: str, messages: list[dict], **extra) -> httpx.Response:
            r = httpx.post(router.url + "/v1/chat/completions", timeout=CLIENT_TIMEOUT, json={
                "model": model, "messages": messages, "max_tokens": 2, "temperature": 0,
                **extra})
            assert r.status_code == 200, r.text
            return r

        done0 = {w: counter(u, "llmserve:request_success_total") for w, u in ids.items()}
        short = [{"role": "user", "content": "What is the capital of France?"}]
        r = ask("auto", short)
        assert r.headers["x-llmserve-tier"] == "small" and r.json()["model"] == "small"
        assert r.headers["x-llmserve-worker"] == by_model["small"]
        assert float(r.headers["x-llmserve-complexity"]) <= 0.35
        assert "x-llmserve-escalated-from" not in r.headers  # auto has no escalate_on
        r = ask("auto", [{"role": "user", "content": CODING_TASK}])
        assert r.headers["x-llmserve-tier"] == "large"
        assert r.headers["x-llmserve-worker"] == by_model["large"]
        done1 = {w: counter(u, "llmserve:request_success_total") for w, u in ids.items()}
        assert {w: done1[w] - done0[w] for w in ids} == {"w0": 1, "w1": 1}

        r = ask("auto-esc", short)  # 2 tokens: stops on length, so the large tier retries
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert (r.headers["x-llmserve-tier"], r.headers["x-llmserve-escalated-from"]) == (
            "large", "small")
        with httpx.stream("POST", router.url + "/v1/chat/completions", timeout=CLIENT_TIMEOUT,
                          json={"model": "auto-esc", "messages": short, "max_tokens": 2,
                                "stream": True}) as s:
            assert s.status_code == 200 and s.headers["x-llmserve-tier"] == "small"
            assert s.read().decode().rstrip().endswith("data: [DONE]")
        done2 = {w: counter(u, "llmserve:request_success_total") for w, u in ids.items()}
        assert {w: done2[w] - done1[w] for w in ids} == {"w0": 2, "w1": 1}

        r = httpx.post(router.url + "/v1/chat/completions", timeout=CLIENT_TIMEOUT,
                       json={"model": "no-such-model", "messages": short})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        text = httpx.get(router.url + "/metrics", timeout=10).text
        assert 'llmserve_router:tier_escalations_total{alias="auto-esc",from_model="small",' \
               'to_model="large"} 1.0' in text
        assert 'llmserve_router:tier_requests_total{alias="auto",model="large"} 1.0' in text
    finally:
        router.stop()


async def _steady(router_url: str, total: int, concurrency: int, kill_after: int, kill):
    results: list[dict] = []
    started = 0

    async def client_loop(client):
        nonlocal started
        while started < total:
            i = started
            started += 1
            if i == kill_after:
                kill()
            t0 = time.monotonic()
            try:
                r = await stream_one(client, router_url, f"Request {i}: say hello {i}.", 8)
            except httpx.HTTPError as e:
                r = {"status": None, "exc": repr(e), "events": [], "worker": None}
            r.update(i=i, t0=t0)
            results.append(r)

    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return sorted(results, key=lambda r: r["i"])


def test_sigkill_worker_under_load_fails_over(workers):  # keep last: kills worker 1
    a, b = workers
    router = start_router([a.url, b.url], "--policy", "round_robin")
    try:
        done_a0 = counter(a.url, "llmserve:request_success_total")
        killed_at = []

        def kill():
            b.proc.send_signal(signal.SIGKILL)
            killed_at.append(time.monotonic())

        results = asyncio.run(_steady(router.url, total=15, concurrency=3, kill_after=5,
                                      kill=kill))
        assert killed_at and b.proc.wait(timeout=30) == -signal.SIGKILL
        ok, failed = [], []
        for r in results:
            assert "exc" not in r, r  # nothing hung past the client timeout
            done = r["status"] == 200 and r["events"] and r["events"][-1] == "[DONE]"
            if done:
                assert r["events"].count("[DONE]") == 1, r["raw"]
                chunk_ids = {json.loads(e)["id"] for e in r["events"][:-1]}
                assert len(chunk_ids) == 1, r["raw"]  # one upstream answer, not two
                ok.append(r)
            else:  # a clean error: a 5xx OpenAI error body, or an SSE error event
                if r["status"] == 200:
                    assert "error" in json.loads(r["events"][-1]), r["raw"]
                else:
                    assert r["status"] in (502, 503) and "error" in json.loads(r["raw"])
                failed.append(r)
        assert len(failed) <= 3, failed  # at most the requests in flight at the kill
        ids = [json.loads(r["events"][0])["id"] for r in ok]
        assert len(ids) == len(set(ids))
        assert all(r["worker"] == "w0" for r in ok if r["t0"] > killed_at[0] + 3.0)
        assert all(r in ok for r in results[-4:])  # traffic moved to the live worker
        # the live worker ran each request it answered exactly once
        served_a = sum(r["worker"] == "w0" for r in ok)
        assert counter(a.url, "llmserve:request_success_total") - done_a0 == served_a
        state = {w["id"]: w for w in httpx.get(router.url + "/workers", timeout=10)
                 .json()["workers"]}
        assert state["w1"]["healthy"] is False and state["w0"]["healthy"] is True
        text = httpx.get(router.url + "/metrics", timeout=10).text
        assert 'llmserve_router:worker_healthy{worker="w1"} 0.0' in text
        print(f"[failover] ok={len(ok)} failed={len(failed)} "
              f"retries={counter(router.url, 'llmserve_router:retries_total')}")
    finally:
        router.stop()

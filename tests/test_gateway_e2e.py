"""End to end: ``llmserve gateway`` processes started from the command line with
``--audit-db`` and a ``gateway.yaml`` holding per-team safety policies, in front of one
real ``llmserve serve`` worker, on one real ``redis-server``.

Oracles: ``llmserve audit verify`` (a separate process) on the gateway's own SQLite
file, and the same file edited with ``sqlite3``; what the worker itself saw (its
``echo: true`` completion text, and its ``prompt_tokens`` for the masked prompt sent to
it directly); the worker's own greedy output, from which the blocked word is picked.
Waits are bounded polls.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("redis")
pytest.importorskip("yaml")

from tests.gateway_procs import MASTER_KEY, start_gateway, start_redis  # noqa: E402
from tests.test_gateway import bearer, make_key, poll  # noqa: E402
from tests.test_server import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.model

ADMIN = {"Authorization": f"Bearer {MASTER_KEY}"}
EMAIL, CARD = "jane.doe@example.com", "4111 1111 1111 1111"  # Luhn-valid test card
GREEDY = {"temperature": 0, "max_tokens": 24}
STORY = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(scope="module")
def worker():
    server = start_server()
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def model(worker):
    return httpx.get(worker.url + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def redis_proc():
    redis = start_redis()
    yield redis
    redis.stop()


def audit_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmserve.entrypoints.cli", "audit", *args],
                          capture_output=True, text=True, timeout=60)


def sse_chunks(lines):
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def test_audit_chain_of_50_requests_verifies_and_tampering_is_named(worker, model, redis_proc,
                                                                     tmp_path):
    db = tmp_path / "audit.db"
    gw = start_gateway(worker.url, redis_proc.url, None, "--audit-db", f"sqlite:///{db}")
    try:
        _, secret = make_key(gw, name="mix", team="audited", role="member")
        h = bearer(secret)

        def plain(i: int) -> int:
            if i % 2:
                r = httpx.post(gw.url + "/v1/completions", headers=h, timeout=120, json={
                    "model": model, "prompt": f"{i} + {i} =", "max_tokens": 2})
            else:
                r = httpx.post(gw.url + "/v1/chat/completions", headers=h, timeout=120, json={
                    "model": model, "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"Count to {i}."}]})
            assert r.status_code == 200, r.text
            return 1

        def streamed(i: int) -> int:
            with httpx.stream("POST", gw.url + "/v1/chat/completions", headers=h, timeout=120,
                              json={"model": model, "max_tokens": 3, "stream": True,
                                    "messages": [{"role": "user",
                                                  "content": f"Name {i} colours."}]}) as s:
                assert s.status_code == 200
                chunks = list(sse_chunks(s.iter_lines()))
            assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
            return 1

        with ThreadPoolExecutor(6) as pool:  # concurrent: the worker batches them
            jobs = [pool.submit(plain, i) for i in range(24)]
            jobs += [pool.submit(streamed, i) for i in range(24)]
            sent = sum(j.result() for j in jobs)
        r = httpx.post(gw.url + "/v1/completions", headers=h, timeout=30,
                       json={"model": "no-such-model", "prompt": "x"})  # rejected: recorded too
        assert r.status_code == 404
        sent += 1
        with httpx.Client(timeout=120, headers=h) as c, c.stream(  # aborted mid-stream
                "POST", gw.url + "/v1/completions", json={
                    "model": model, "prompt": STORY, "max_tokens": 1000, "ignore_eos": True,
                    "stream": True}) as s:
            lines = s.iter_lines()
            assert next(sse_chunks(lines))["choices"]
        sent += 1
        assert sent == 50

        def count():
            if not db.exists():
                return 0
            with sqlite3.connect(db) as con:
                n = con.execute("SELECT count(*) FROM audit_log").fetchone()[0]
            return n

        assert poll(lambda: count() >= sent, timeout=20), count()
        assert count() == sent
        with sqlite3.connect(db) as con:
            outcomes = [json.loads(r)["outcome"] for (r,) in
                        con.execute("SELECT record FROM audit_log ORDER BY seq")]
        assert "aborted" in outcomes and outcomes.count("ok") == 48, outcomes
    finally:
        gw.stop()

    r = audit_cli("verify", "--audit-db", f"sqlite:///{db}")
    assert r.returncode == 0, r.stderr
    assert f"OK: {sent} records" in r.stdout
    from tests.test_audit import _swap

    for tamper, name in (("delete", "deleted"), ("swap", "reordered")):
        copy = tmp_path / f"{tamper}.db"
        with sqlite3.connect(db) as src, sqlite3.connect(copy) as dst:
            src.backup(dst)  # (the log is in WAL mode: a file copy may miss rows)
        with sqlite3.connect(copy) as con:
            if tamper == "delete":
                con.execute("DELETE FROM audit_log WHERE seq = 23")
            else:
                _swap(con, 10, 30)
        r = audit_cli("verify", "--audit-db", f"sqlite:///{copy}")
        assert r.returncode == 1 and name in r.stderr, (tamper, r.stderr)
        assert re.search(r"\bseq (23|10)\b", r.stderr), r.stderr
    with sqlite3.connect(db) as con:  # edit one row's response text, keep it valid JSON
        (rec,) = con.execute("SELECT record FROM audit_log WHERE seq = 9").fetchone()
        rec = json.loads(rec)
        rec["response"] = (rec.get("response") or "") + " (edited)"
        con.execute("UPDATE audit_log SET record = ? WHERE seq = 9", (json.dumps(rec),))
    r = audit_cli("verify", "--audit-db", f"sqlite:///{db}")
    assert r.returncode == 1
    assert re.search(r"\bseq 9\b", r.stderr) and "edited" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def blocked_word(worker, model):
    """A word of the worker's own greedy continuation of STORY, past its start."""
    r = httpx.post(worker.url + "/v1/completions", timeout=120,
                   json={"model": model, "prompt": STORY, **GREEDY})
    text = r.json()["choices"][0]["text"]
    words = re.findall(r"[A-Za-z]{4,}", text)
    word = next((w for w in words[1:] if text.index(w) >= 8), None)
    assert word, f"no usable word in the greedy output {text!r}"
    return text, word


@pytest.fixture(scope="module")
def safety_gw(worker, redis_proc, blocked_word, tmp_path_factory):
    d = tmp_path_factory.mktemp("gwsafety")
    rules = d / "words.yaml"
    rules.write_text(json.dumps({"categories": {"test_word": {"group": "harmful", "patterns": [
        {"id": "test-word", "regex": rf"\b{re.escape(blocked_word[1])}\b"}]}}}))
    cfg = d / "gateway.yaml"
    cfg.write_text(json.dumps({  # JSON is YAML
        "audit_db": f"sqlite:///{d / 'audit.db'}",
        "safety": {"masked": {"input": [{"check": "pii", "action": "mask"}]},
                   "filtered": {"output": [{"check": "harmful", "action": "block",
                                            "files": [str(rules)]}]}}}))
    gw = start_gateway(worker.url, redis_proc.url, str(cfg))
    yield gw
    gw.stop()


def test_masked_pii_never_reaches_the_worker(worker, model, safety_gw):
    _, secret = make_key(safety_gw, name="pii", team="masked", role="member")
    prompt = f"Write to {EMAIL} and charge card {CARD} today."
    masked = "Write to [EMAIL] and charge card [CARD] today."
    r = httpx.post(safety_gw.url + "/v1/completions", headers=bearer(secret), timeout=120,
                   json={"model": model, "prompt": prompt, "max_tokens": 1, "echo": True})
    assert r.status_code == 200, r.text
    seen = r.json()["choices"][0]["text"]  # echo: the prompt the worker decoded
    assert seen.startswith(masked), seen
    assert EMAIL not in seen and "4111" not in seen
    tok = httpx.post(worker.url + "/tokenize", json={"model": model, "prompt": masked},
                     timeout=30).json()
    assert r.json()["usage"]["prompt_tokens"] == tok["count"]

    msgs = [{"role": "user", "content": prompt}]
    r = httpx.post(safety_gw.url + "/v1/chat/completions", headers=bearer(secret),
                   timeout=120, json={"model": model, "messages": msgs, "max_tokens": 1})
    direct = httpx.post(worker.url + "/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": masked}]})
    assert r.status_code == 200 and direct.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"]
    raw = httpx.post(worker.url + "/tokenize", json={"model": model, "messages": msgs},
                     timeout=30).json()
    assert raw["count"] != direct.json()["usage"]["prompt_tokens"]  # masking changed it


def test_output_policy_cuts_stream_before_the_blocked_word(model, safety_gw, blocked_word):
    greedy_text, word = blocked_word
    _, secret = make_key(safety_gw, name="filter", team="filtered", role="member")
    _, other = make_key(safety_gw, name="free", team="unfiltered", role="member")
    body = {"model": model, "prompt": STORY, "stream": True, **GREEDY}
    got, finish = "", None
    with httpx.stream("POST", safety_gw.url + "/v1/completions", headers=bearer(secret),
                      json=body, timeout=120) as s:
        assert s.status_code == 200
        for chunk in sse_chunks(s.iter_lines()):
            for ch in chunk["choices"]:
                got += ch.get("text") or ""
                assert word not in got, got  # never sent, not even in part of a stream
                finish = ch.get("finish_reason") or finish
    assert finish == "content_filter"
    assert greedy_text[:greedy_text.index(word)].startswith(got) and got, (got, greedy_text)
    # a team without the output policy gets the whole greedy text, word included
    r = httpx.post(safety_gw.url + "/v1/completions", headers=bearer(other), timeout=120,
                   json={**body, "stream": False})
    assert r.json()["choices"][0]["text"] == greedy_text


def test_team_safety_policy_set_at_run_time(model, safety_gw):
    """A policy PUT on a team through the admin API applies to its next requests (on
    top of the file's ``safety`` section, which does not name this team)."""
    _, secret = make_key(safety_gw, name="rt", team="runtime", role="member")
    body = {"model": model, "prompt": f"Mail {EMAIL} now.", "max_tokens": 1}

    def status() -> int:
        return httpx.post(safety_gw.url + "/v1/completions", headers=bearer(secret),
                          json=body, timeout=120).status_code

    assert status() == 200
    bad = httpx.put(safety_gw.url + "/admin/teams/runtime", headers=ADMIN, timeout=30,
                    json={"safety": {"input": [{"check": "no-such-check"}]}})
    assert bad.status_code == 400 and "safety" in bad.json()["error"]["message"]
    r = httpx.put(safety_gw.url + "/admin/teams/runtime", headers=ADMIN, timeout=30,
                  json={"safety": {"input": [{"check": "pii", "action": "block"}]}})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10  # the key cache holds team records < 1 s
    while status() != 400 and time.monotonic() < deadline:
        time.sleep(0.2)
    r = httpx.post(safety_gw.url + "/v1/completions", headers=bearer(secret), json=body,
                   timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "content_filter"
    r = httpx.put(safety_gw.url + "/admin/teams/runtime", headers=ADMIN, timeout=30, json={})
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while status() != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status() == 200

"""``llmserve gateway`` as real processes on loopback: two replicas on one real
``redis-server``, in front of one real ``llmserve serve`` worker (the default model,
served under two names so model allowlists can be checked).

Oracles: the worker's own ``/tokenize`` and usage numbers, the HTTP codes and OpenAI
error bodies the API promises, the gateway's Prometheus counters, and the limits
themselves (``rpm: 5`` -> exactly five successes). Waits are bounded polls. The hook
points are in ``test_gateway_hooks.py``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("redis")
pytest.importorskip("yaml")

from tests.gateway_procs import MASTER_KEY, start_gateway, start_redis  # noqa: E402
from tests.test_server import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.model

MODEL_A, MODEL_B = "smollm2-135m-instruct", "model-b"
ADMIN = {"Authorization": f"Bearer {MASTER_KEY}"}
HI = [{"role": "user", "content": "Say hi."}]


def bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture(scope="module")
def worker():
    server = start_server("--served-model-name", MODEL_A, MODEL_B)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def yaml_key(tmp_path_factory):
    from llmserve.gateway.keys import hash_secret, new_secret

    key_id, secret = new_secret("from-yaml")
    path = tmp_path_factory.mktemp("gwcfg") / "gateway.yaml"
    path.write_text(json.dumps({  # JSON is YAML
        "teams": {"research": {"rpm": 1000}},
        "keys": [{"id": key_id, "key_hash": hash_secret(secret), "name": "ci",
                  "team": "research", "role": "member"}]}))
    return str(path), key_id, secret


@pytest.fixture(scope="module")
def redis_proc():
    redis = start_redis()
    yield redis
    redis.stop()


@pytest.fixture(scope="module")
def gws(worker, yaml_key, redis_proc):
    a = start_gateway(worker.url, redis_proc.url, yaml_key[0])
    b = start_gateway(worker.url, redis_proc.url, yaml_key[0])
    yield a, b
    a.stop()
    b.stop()


def make_key(gw, **fields) -> tuple[str, str]:
    r = httpx.post(gw.url + "/admin/keys", json=fields, headers=ADMIN, timeout=10)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["key"].startswith("sk-") and "key_hash" not in body
    return body["id"], body["key"]


def chat(gw, secret, model=MODEL_A, max_tokens=1, **extra) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", headers=bearer(secret), timeout=120,
                      json={"model": model, "messages": HI, "max_tokens": max_tokens,
                            "temperature": 0, **extra})


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    if code is not None:
        assert err["code"] == code, err
    return err


def poll(fn, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(0.05)


def test_gateway_imports_neither_torch_nor_engine():
    code = ("import sys, llmserve.gateway.app, llmserve.gateway.cli; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('llmserve.engine')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_only_health_answers_without_a_valid_key(gws):
    a, _ = gws
    assert httpx.get(a.url + "/health").json() == {"status": "ok"}
    calls = [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
             ("POST", "/v1/completions"), ("GET", "/admin/keys"), ("POST", "/admin/keys"),
             ("GET", "/admin/usage"), ("GET", "/metrics"), ("GET", "/no/such/path"),
             ("GET", "/v1/chat/completions"), ("GET", "/docs"), ("GET", "/openapi.json"),
             ("POST", "/tokenize")]
    bad_headers = [{}, bearer("sk-nosuchkey.AAAAAAAAAAAAAAAAAAAAAAAA"), bearer("wrong"),
                   {"Authorization": "Basic " + MASTER_KEY}, {"Authorization": "Bearer"},
                   bearer(MASTER_KEY + "x")]
    for method, path in calls:
        for h in bad_headers:
            r = httpx.request(method, a.url + path, headers=h, json={}, timeout=10)
            assert_error(r, 401, "invalid_api_key")


def test_yaml_key_and_admin_listing(gws, yaml_key):
    a, b = gws
    _, key_id, secret = yaml_key
    for gw in gws:
        r = httpx.get(gw.url + "/v1/models", headers=bearer(secret), timeout=10)
        assert r.status_code == 200 and {m["id"] for m in r.json()["data"]} == {MODEL_A,
                                                                                MODEL_B}
    keys = httpx.get(b.url + "/admin/keys", headers=ADMIN).json()["data"]
    rec = next(k for k in keys if k["id"] == key_id)
    assert rec["team"] == "research" and "key_hash" not in rec
    assert secret not in a.log() + b.log()


def test_revoked_or_expired_key_refused_by_every_replica_within_one_second(gws):
    a, b = gws
    kid, secret = make_key(a, name="soon-revoked", role="member")
    kid2, secret2 = make_key(b, name="soon-expired", role="member")
    for gw in gws:  # both replicas have them cached now
        for s in (secret, secret2):
            assert httpx.get(gw.url + "/v1/models", headers=bearer(s)).status_code == 200
    assert httpx.delete(a.url + f"/admin/keys/{kid}", headers=ADMIN).json()["revoked"]
    r = httpx.patch(b.url + f"/admin/keys/{kid2}", headers=ADMIN,
                    json={"expires_at": time.time() - 1})
    assert r.status_code == 200, r.text
    time.sleep(1.0)
    for gw in gws:
        for s in (secret, secret2):
            assert_error(httpx.get(gw.url + "/v1/models", headers=bearer(s)), 401)
            assert_error(chat(gw, s), 401)
    _, past = make_key(a, expires_at="2020-01-01T00:00:00Z")
    assert_error(httpx.get(b.url + "/v1/models", headers=bearer(past)), 401)


def test_member_and_viewer_rbac_usage_and_metrics(gws):
    a, b = gws
    mid, member = make_key(a, name="m", role="member", team="rbac")
    oid, _other = make_key(a, name="o", role="member")
    _, viewer = make_key(a, name="v", role="viewer")
    for method, path in [("GET", "/admin/keys"), ("POST", "/admin/keys"),
                         ("GET", f"/admin/keys/{oid}"), ("PATCH", f"/admin/keys/{oid}"),
                         ("DELETE", f"/admin/keys/{oid}"), ("GET", "/admin/teams"),
                         ("GET", f"/admin/usage?key_id={oid}"), ("GET", "/admin/usage?team=x"),
                         ("GET", "/metrics")]:
        for s in (member, viewer):
            r = httpx.request(method, b.url + path, headers=bearer(s), json={"name": "x"})
            assert_error(r, 403, "insufficient_role")
    assert_error(chat(a, viewer), 403, "insufficient_role")
    assert httpx.get(a.url + "/v1/models", headers=bearer(viewer)).status_code == 200
    r = httpx.post(
        b.url + "/v1/chat/completions", timeout=120,
        headers={**bearer(member), "X-Request-Id": "req-abc.123"},
        json={"model": MODEL_A, "messages": HI, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "req-abc.123"
    usage = r.json()["usage"]

    def own_usage():
        rows = httpx.get(a.url + "/admin/usage", headers=bearer(member)).json()["data"]
        return rows if rows and rows[0].get("requests") == 1 else None

    rows = poll(own_usage)
    assert rows and len(rows) == 1 and rows[0]["key_id"] == mid and rows[0]["model"] == MODEL_A
    assert rows[0]["prompt_tokens"] == usage["prompt_tokens"]
    assert rows[0]["completion_tokens"] == usage["completion_tokens"]
    team_rows = httpx.get(a.url + "/admin/usage?team=rbac", headers=ADMIN).json()["data"]
    assert team_rows[0]["team"] == "rbac" and team_rows[0]["requests"] == 1
    text = httpx.get(b.url + "/metrics", headers=ADMIN).text
    assert (f'llmserve_gateway:requests_total{{code="200",key="{mid}",model="{MODEL_A}",'
            f'team="rbac"}} 1.0') in text
    assert "llmserve_gateway:upstream_latency_seconds_count" in text


def test_model_allowlists_of_key_and_team(gws):
    a, b = gws
    _, only_a = make_key(a, models=[MODEL_A])
    assert_error(chat(b, only_a, model=MODEL_B), 403, "model_not_allowed")
    assert chat(b, only_a, model=MODEL_A).status_code == 200
    ids = [m["id"] for m in httpx.get(a.url + "/v1/models", headers=bearer(only_a)).json()["data"]]
    assert ids == [MODEL_A]
    r = httpx.put(a.url + "/admin/teams/b-only", headers=ADMIN, json={"models": [MODEL_B]})
    assert r.status_code == 200, r.text
    _, in_team = make_key(a, team="b-only", models=[MODEL_A])  # intersection: nothing
    assert_error(chat(b, in_team, model=MODEL_A), 403, "model_not_allowed")
    assert_error(chat(b, in_team, model=MODEL_B), 403, "model_not_allowed")
    _, free = make_key(a)
    assert_error(chat(a, free, model="no-such-model"), 404, "model_not_found")


async def _fire(jobs):
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(job(client) for job in jobs))


def test_rpm_5_over_two_replicas_exactly_5_succeed(gws):
    a, b = gws
    kid, secret = make_key(a, rpm=5, team="rpm-team")

    def job(gw):
        async def run(client):
            return await client.post(gw.url + "/v1/chat/completions", headers=bearer(secret),
                                     json={"model": MODEL_A, "messages": HI, "max_tokens": 1})
        return run

    results = asyncio.run(_fire([job(gws[i % 2]) for i in range(12)]))
    codes = sorted(r.status_code for r in results)
    assert codes == [200] * 5 + [429] * 7, codes
    for r in results:
        if r.status_code == 429:
            assert assert_error(r, 429, "rpm")["type"] == "rate_limit_exceeded"
            assert 1 <= int(r.headers["retry-after"]) <= 60
    rejected = 0
    for gw in gws:
        for line in httpx.get(gw.url + "/metrics", headers=ADMIN).text.splitlines():
            if line.startswith("llmserve_gateway:rate_limit_rejections_total{") and \
                    f'key="{kid}"' in line:
                rejected += float(line.rsplit(" ", 1)[1])
    assert rejected == 7


def test_team_limits_apply_on_top_of_key_limits(gws):
    a, b = gws
    r = httpx.put(a.url + "/admin/teams/rpm2", headers=ADMIN, json={"rpm": 2})
    assert r.status_code == 200, r.text
    keys = [make_key(a, team="rpm2", rpm=10)[1] for _ in range(2)]
    codes = [chat(gws[i % 2], keys[i % 2]).status_code for i in range(3)]
    assert codes == [200, 200, 429], codes
    err = assert_error(chat(b, keys[1]), 429, "rpm")
    assert "team rpm2" in err["message"]


def _tokens(worker, messages) -> int:
    r = httpx.post(worker.url + "/tokenize", json={"model": MODEL_A, "messages": messages})
    return r.json()["count"]


def test_tpm_reserves_at_admission_and_refunds_unused(gws, worker):
    a, b = gws
    max_tokens = 16  # small: the test machine may be slow; "stop" leaves some unused
    cost = _tokens(worker, HI) + max_tokens
    tpm = 2 * cost + cost // 2
    kid, secret = make_key(a, tpm=tpm)

    def job(gw):
        async def run(client):
            body = {"model": MODEL_A, "messages": HI, "max_tokens": max_tokens, "stop": ["!"],
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", gw.url + "/v1/chat/completions",
                                     headers=bearer(secret), json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, r.json(), None
                usage = None
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ev = json.loads(line[6:])
                        usage = ev.get("usage") or usage
                return 200, None, usage
        return run

    results = asyncio.run(_fire([job(gws[i % 2]) for i in range(5)]))
    ok = [u for code, _, u in results if code == 200]
    assert ok, results
    for code, err, _ in results:
        if code != 200:
            assert code == 429 and err["error"]["code"] == "tpm", err
    used = sum(u["prompt_tokens"] + u["completion_tokens"] for u in ok)
    assert used <= tpm  # never over the limit
    assert all(u["completion_tokens"] <= max_tokens for u in ok)

    def window():
        w = httpx.get(a.url + f"/admin/keys/{kid}", headers=ADMIN).json()["window"]
        return w if w["tokens_last_minute"] == used else None

    w = poll(window)  # the unused part of every reservation came back
    assert w is not None and w["parallel_requests"] == 0
    r = chat(b, secret, max_tokens=max_tokens)
    assert r.status_code == (200 if tpm - used >= cost else 429), r.text


def test_parallel_limit_and_aborted_stream_settles(gws, worker):
    a, b = gws
    kid, secret = make_key(a, max_parallel_requests=1, daily_token_quota=100000)
    body = {"model": MODEL_A, "messages": HI, "max_tokens": 1000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", a.url + "/v1/chat/completions", headers=bearer(secret), json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # hold the iterator: dropping it closes the stream
        assert next(lines).startswith("data: ")
        w = httpx.get(b.url + f"/admin/keys/{kid}", headers=ADMIN).json()["window"]
        assert w["parallel_requests"] == 1, w
        assert_error(chat(b, secret), 429, "parallel")
    # the client went away mid-stream: the lease is released, unused tokens refunded

    def window():
        w = httpx.get(b.url + f"/admin/keys/{kid}", headers=ADMIN).json()["window"]
        return w if w["parallel_requests"] == 0 else None

    w = poll(window)
    assert w is not None and w["tokens_today"] < _tokens(worker, HI) + 1000
    assert chat(b, secret).status_code == 200


def test_bad_input_gets_4xx_openai_errors_and_gateway_keeps_serving(gws):
    a, _ = gws
    _, key = make_key(a)
    url = a.url + "/v1/chat/completions"
    h = {**bearer(key), "Content-Type": "application/json"}
    assert_error(httpx.post(url, headers=h, content=b"{not json"), 400)
    assert_error(httpx.post(url, headers=h, content=b"[1, 2]"), 400)
    assert_error(httpx.post(url, headers=h, content=b"\xff\xfe"), 400)
    assert_error(httpx.post(url, headers=h, content=b"x" * (5 * 1024 * 1024)), 413,
                 "request_too_large")
    for body, param in [({"model": 5, "messages": HI}, "model"),
                        ({"messages": HI}, "model"),
                        ({"model": MODEL_A, "messages": HI, "stream": "yes"}, "stream"),
                        ({"model": MODEL_A, "messages": HI, "max_tokens": "9"}, "max_tokens"),
                        ({"model": MODEL_A, "messages": HI, "n": 0}, "n"),
                        ({"model": MODEL_A, "messages": "hi"}, "messages"),
                        ({"model": MODEL_A, "messages": HI, "stream_options": 3},
                         "stream_options")]:
        assert assert_error(httpx.post(url, headers=h, json=body), 400)["param"] == param
    assert_error(httpx.post(a.url + "/v1/completions", headers=h,
                            json={"model": MODEL_A, "prompt": {"a": 1}}), 400)
    # the gateway checks bodies with the server's own models (llmserve.protocol)
    for body in ({"model": MODEL_A, "messages": HI, "temperature": "hot"},
                 {"model": MODEL_A, "messages": [1, 2]}):
        err = assert_error(httpx.post(url, headers=h, json=body), 400)
        assert err["param"] == ("temperature" if "temperature" in body else "messages")
    assert_error(httpx.post(url, headers=h, json={"model": "nope", "messages": HI}), 404)
    two_auth = [("Authorization", f"Bearer {key}"), ("Authorization", f"Bearer {MASTER_KEY}")]
    assert_error(httpx.post(url, headers=two_auth, json={"model": MODEL_A, "messages": HI}),
                 401)
    assert_error(httpx.post(url, headers={"Authorization": b"Bearer sk-\xff\xfe.aaaaaaaa"},
                            json={}), 401)
    assert_error(httpx.post(url, headers=bearer("sk-" + "a" * 5000)), 401)
    host, port = a.url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # raw: a bad length
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: "
                     b"Bearer " + key.encode() + b"\r\nContent-Length: abc\r\n\r\n{}")
        assert sock.recv(4096).startswith(b"HTTP/1.1 4")
    r = httpx.post(url, headers={**h, "X-Request-Id": "bad id with spaces"},
                   json={"model": MODEL_A, "messages": HI, "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-request-id"].startswith("gw-")
    assert httpx.get(a.url + "/health").status_code == 200


def test_redis_down_fails_closed_by_default_and_open_when_configured(worker, tmp_path):
    redis = start_redis()
    cfg = tmp_path / "open.yaml"
    cfg.write_text("fail_open: {auth: true, rpm: true, tpm: true, parallel: true, quota: true}\n")
    closed = start_gateway(worker.url, redis.url)
    opened = start_gateway(worker.url, redis.url, str(cfg))
    try:
        _, secret = make_key(closed, rpm=100)
        assert chat(closed, secret).status_code == 200
        assert chat(opened, secret).status_code == 200
        redis.stop()
        assert_error(chat(closed, secret), 503)
        time.sleep(1.0)  # past the replicas' 0.5 s local key cache: auth itself needs Redis
        assert_error(httpx.get(closed.url + "/v1/models", headers=bearer(secret)), 503)
        assert chat(opened, secret).status_code == 200
        assert httpx.get(closed.url + "/health").status_code == 200
    finally:
        closed.stop()
        opened.stop()
        redis.stop()

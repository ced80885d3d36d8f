"""Priority lanes end to end: a ``llmserve gateway`` process in front of a real worker
started with ``--scheduling-policy priority --max-num-seqs 1``. A VIP key's priority
(lower value = served first, as the engine and vLLM order it) overtakes bulk requests
that were queued before it.

Oracle: the order in which the streams' first tokens reach the client, with the bulk
requests provably waiting in the worker's queue (its own ``num_requests_waiting``
gauge) before the VIP request is sent. No timing thresholds.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("redis")
pytest.importorskip("yaml")

from tests.gateway_procs import start_gateway, start_redis  # noqa: E402
from tests.test_gateway import bearer, make_key  # noqa: E402
from tests.test_server import start_server, stop_server, wait_metrics  # noqa: E402

pytestmark = pytest.mark.model

PROMPT = [{"role": "user", "content": "Tell me a long story about a cat."}]


@pytest.fixture(scope="module")
def lane():
    worker = start_server("--scheduling-policy", "priority", "--max-num-seqs", "1")
    redis = start_redis()
    gw = start_gateway(worker.url, redis.url)
    yield worker, gw
    gw.stop()
    redis.stop()
    stop_server(worker)


def test_vip_key_overtakes_queued_bulk_requests(lane):
    worker, gw = lane
    model = httpx.get(worker.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    _, vip = make_key(gw, name="vip", team="vip", role="member", priority=-10)
    _, bulk = make_key(gw, name="bulk", team="bulk", role="member", priority=10)
    first_token: dict[str, float] = {}
    errors: list[str] = []

    def stream(name: str, secret: str, max_tokens: int) -> None:
        body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "priority": -100}  # a client's own priority is replaced by its key's
        try:
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                              headers=bearer(secret), timeout=180) as s:
                if s.status_code != 200:
                    errors.append(f"{name}: {s.status_code} {s.read()!r}")
                    return
                for line in s.iter_lines():  # the first chunk (role, "") is sent at once
                    if name in first_token or not line.startswith("data: {"):
                        continue
                    if any(c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
                        first_token[name] = time.monotonic()
        except Exception as e:  # reported below, never hangs the test
            errors.append(f"{name}: {e!r}")

    threads = [threading.Thread(target=stream, args=("b0", bulk, 40), daemon=True)]
    threads[0].start()
    deadline = time.monotonic() + 60
    while "b0" not in first_token and not errors and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "b0" in first_token, errors  # b0 runs: the worker's one sequence slot is taken
    for name in ("b1", "b2", "b3"):
        threads.append(threading.Thread(target=stream, args=(name, bulk, 3), daemon=True))
        threads[-1].start()
    wait_metrics(worker.url, lambda m: m["llmserve:num_requests_waiting"] == 3
                 or len(first_token) > 1, timeout=60)
    assert len(first_token) == 1, first_token  # b1..b3 all queued behind b0, none started
    threads.append(threading.Thread(target=stream, args=("vip", vip, 3), daemon=True))
    threads[-1].start()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    assert set(first_token) == {"b0", "b1", "b2", "b3", "vip"}, first_token
    order = sorted(first_token, key=first_token.get)
    assert order.index("vip") < min(order.index(b) for b in ("b1", "b2", "b3")), order

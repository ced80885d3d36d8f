"""Server flags that need their own process: ``--api-key`` (401 everywhere but
``/health``, and ``/metrics`` with ``--allow-unauthenticated-metrics``), a full waiting
queue (503 with ``--max-num-seqs 2 --max-waiting-requests 1``), and a graceful
SIGTERM (requests in flight finish, the rest are aborted after
``--shutdown-timeout``, exit code 0).

Waits are bounded polls on /metrics; the only clock is ``--shutdown-timeout``
(15 s), far longer than the 3 tokens the short request still needs and far shorter
than the 4000 of the long one.
"""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from tests.test_server import MODEL, PROMPT, start_server, stop_server, wait_metrics

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "temperature": 0,
        "stream": True}


@pytest.fixture(scope="module")
def server():
    server = start_server("--api-key", KEY, "--max-num-seqs", "2", "--max-waiting-requests",
                          "1", "--shutdown-timeout", "15", "--served-model-name", MODEL,
                          "other-name", "--allow-unauthenticated-metrics")
    yield server
    stop_server(server)


def _idle(m):
    return (m["llmserve:num_requests_running"] == 0
            and m["llmserve:num_requests_waiting"] == 0)


def test_api_key_required_everywhere_but_health_and_metrics(server):
    body = {"prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    for method, path, payload in [("POST", "/tokenize", {"prompt": PROMPT}),
                                  ("POST", "/detokenize", {"tokens": [1, 2]}),
                                  ("GET", "/v1/models", None), ("GET", "/version", None)]:
        r = httpx.request(method, server.url + path, json=payload)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.request(method, server.url + path, json=payload,
                             headers=AUTH).status_code == 200, path
    assert httpx.get(server.url + "/health").status_code == 200
    assert "llmserve:num_requests_running" in httpx.get(server.url + "/metrics").text
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="other-name", prompt=PROMPT, max_tokens=2).model \
        == "other-name"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0) \
            .models.list()


async def _stream(client: httpx.AsyncClient, url: str, body: dict, first: asyncio.Event):
    """Read an SSE stream; returns (text, saw [DONE], finish_reason)."""
    text, done, reason = "", False, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers=AUTH) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    reason = choice["finish_reason"] or reason
                    first.set()
    except httpx.TransportError:  # the server went away mid-stream
        pass
    return text, done, reason


def test_full_waiting_queue_is_503_then_recovers(server):
    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            firsts = [asyncio.Event() for _ in range(2)]
            running = [asyncio.create_task(_stream(client, server.url, LONG, ev))
                       for ev in firsts]
            for ev in firsts:
                await ev.wait()  # both slots (--max-num-seqs 2) are taken
            queued = asyncio.create_task(_stream(client, server.url, LONG, asyncio.Event()))
            await asyncio.to_thread(wait_metrics, server.url,
                                    lambda m: m["llmserve:num_requests_waiting"] == 1)
            r = await client.post(server.url + "/v1/completions", headers=AUTH,
                                  json={"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == 503 and "waiting" in r.json()["error"]["message"]
            for task in [*running, queued]:
                task.cancel()  # hang up: the server aborts all three
            await asyncio.gather(*running, queued, return_exceptions=True)

    asyncio.run(run())
    wait_metrics(server.url, _idle)
    ok = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=300,
                    json={"prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200


def test_sigterm_finishes_in_flight_aborts_the_rest_exits_0(server):
    """The long request (4000 tokens) outlasts --shutdown-timeout and is aborted; the
    short one, in flight when SIGTERM arrives, needs only 3 more tokens and finishes."""
    wait_metrics(server.url, _idle)
    short = {**LONG, "max_tokens": 4}

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            first_l, first_s = asyncio.Event(), asyncio.Event()
            long_ = asyncio.create_task(_stream(client, server.url, LONG, first_l))
            await first_l.wait()
            s = asyncio.create_task(_stream(client, server.url, short, first_s))
            await first_s.wait()
            server.proc.send_signal(signal.SIGTERM)
            return await s, await long_

    (s_text, s_done, s_reason), (_, l_done, l_reason) = asyncio.run(run())
    assert s_done and s_reason == "length" and s_text  # finished normally
    assert l_done and l_reason == "abort"  # aborted once the shutdown timeout passed
    assert server.proc.wait(timeout=120) == 0, server.log()
    assert "Application shutdown complete" in server.log()

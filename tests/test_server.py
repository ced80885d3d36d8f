"""The OpenAI-compatible server as a real process on a free loopback port, driven by
the official ``openai`` client and raw httpx.

One server (float32, the default model) serves the whole module; the offline
``LLM`` (float32, same model) is the reference for greedy text. Waits are bounded
polls; no assertion depends on how fast anything runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Give me three tips for writing clear Python code."}]
START_TIMEOUT = 300.0  # bound on model loading (seconds); the machine may be busy


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


def start_server(*extra: str) -> Server:
    """``llmserve serve --port 0`` (float32), waiting until /health is 200; every
    answer before that must be a 503 in OpenAI's error shape."""
    fd, log_path = tempfile.mkstemp(prefix="llmserve-", suffix=".log")
    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "serve", "--port", "0",
           "--dtype", "float32", "--kv-cache-memory", "256MiB",
           "--disable-uvicorn-access-log", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, "", log_path)
    deadline = time.monotonic() + START_TIMEOUT
    while not server.url:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", server.log())
        if m:
            server.url = m.group(1)
        elif proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not start:\n{server.log()}")
        else:
            time.sleep(0.05)
    while True:
        try:
            r = httpx.get(server.url + "/health", timeout=10)
            if r.status_code == 200:
                return server
            assert r.status_code == 503 and "error" in r.json(), r.text
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server never became healthy:\n{server.log()}")
        time.sleep(0.1)


def stop_server(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            return server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            raise
    return server.proc.returncode


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as {'name{label="v",...}': value} (model_name label dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())
                              if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_metrics(url: str, predicate, timeout: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if predicate(m):
            return m
        assert time.monotonic() < deadline, f"metrics never satisfied the condition: {m}"
        time.sleep(0.05)


def sse_events(response) -> list:
    """Parse an SSE body from a streamed httpx response: each event's bytes must be
    whole UTF-8 (no character split across events)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@pytest.fixture(scope="module")
def server_proc():
    server = start_server()
    yield server
    assert stop_server(server) == 0, server.log()


@pytest.fixture(scope="module")
def server(server_proc, llm_fp32):
    # llm_fp32 (the reference) loads in this process while the server loads
    return server_proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _greedy(max_tokens: int, **kw):
    from llmserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_models_health_version(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] > 0
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_greedy_matches_llm_streamed_and_not(client, llm_fp32):
    ref = llm_fp32.generate([PROMPT], _greedy(16), use_tqdm=False)[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert resp.choices[0].text == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    with_usage = [i for i, c in enumerate(chunks) if c.usage is not None]
    assert with_usage == [len(chunks) - 1] and chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == resp.usage.model_dump()


def test_chat_greedy_matches_llm_streamed_and_not(client, llm_fp32):
    ref = llm_fp32.chat(CHAT, _greedy(16), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                          temperature=0)
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    with_usage = [i for i, c in enumerate(chunks) if c.usage is not None]
    assert with_usage == [len(chunks) - 1] and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_stop_string_never_leaks_into_the_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                     temperature=0).choices[0].text
    stop = full[len(full) // 3:len(full) // 3 + 6]  # a multi-token piece in the middle
    expected = full[:full.index(stop)]
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], stream=True)]
    # deltas only ever append, so any leaked character would remain in the join
    assert "".join(pieces) == expected


def test_multibyte_characters_arrive_whole(server):
    body = {"model": MODEL, "prompt": "请用中文介绍一下长城的历史。长城", "max_tokens": 16,
            "temperature": 0}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()
    text = full["choices"][0]["text"]
    assert any(ord(ch) > 0x7F for ch in text), text
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=300) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    pieces = [e["choices"][0]["text"] for e in events[:-1]]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_n_choices_logprobs_and_echo(client):
    resp = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello, my name is"],
                                     max_tokens=4, temperature=0.8, seed=3, n=2, logprobs=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    again = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello, my name is"],
                                      max_tokens=4, temperature=0.8, seed=3, n=2, logprobs=2)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # seeded
    for c in resp.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4
        assert all(len(t) >= 2 for t in lp.top_logprobs)
    assert resp.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                     echo=True)
    assert echo.choices[0].text.startswith(PROMPT) and len(echo.choices[0].text) > len(PROMPT)


def test_tokenize_detokenize(server, llm_fp32):
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == llm_fp32.get_tokenizer().encode(PROMPT) and r["count"] == len(r["tokens"])
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json() == {
        "prompt": PROMPT}
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > r["count"]


ERROR_CASES = [
    # (path, body, status, param, substring of the message)
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"prompt": PROMPT, "stream": 1}, 400, "stream", "bool"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 5}, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, 400, "n", "n must"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt", "token id"),
    ("/v1/completions", {"prompt": [1] * 8192}, 400, "prompt", "8192"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8190}, 400, "max_tokens",
     "8195 tokens (5 in the prompt, 8190 in the completion)"),
    ("/v1/completions", {"prompt": PROMPT, "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages", "role"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs",
     "logprobs"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "list"),
    ("/v1/nothing-here", {}, 404, None, "Not Found"),
    # request chat templates need --trust-request-chat-template (tests/test_server_hardening.py)
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {
        "chat_template": "HELLO {{ messages[0]['content'] }}"}}, 400, "chat_template_kwargs",
     "--trust-request-chat-template"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 1/0 }}"}, 400,
     "chat_template", "--trust-request-chat-template"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, 400,
     "chat_template_kwargs", "request field tools"),
    # the 256 MiB KV cache holds 5808 tokens, less than max_model_len (8192)
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6000}, 400, "max_tokens",
     "KV cache holds 5808 tokens"),
]


@pytest.mark.parametrize("path,body,status,param,needle", ERROR_CASES)
def test_errors_have_openai_shape_and_the_next_request_works(server, path, body, status,
                                                             param, needle):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and needle in err["message"], err
    ok = httpx.post(server.url + "/v1/completions", timeout=300,
                    json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_malformed_json_is_a_400_and_sdk_raises(server, client):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] is None
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100_000)


def test_32_concurrent_streams_finish_and_are_batched(server, llm_fp32):
    distinct = [f"Fact number {i} about the number {i * 7}:" for i in range(4)]
    prompts = [distinct[i % 4] for i in range(32)]  # 32 requests, 4 references to compute
    ref_of = {p: o.outputs[0] for p, o in
              zip(distinct, llm_fp32.generate(distinct, _greedy(8), use_tqdm=False))}
    refs = [ref_of[p] for p in prompts]
    before = metrics(server.url)
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                 max_retries=0, timeout=600)

    async def one(prompt):
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True})
        text, usage, reason = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return text, usage, reason

    async def run():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert [t for t, _, _ in results] == [r.text for r in refs]
    assert [(r, u.completion_tokens) for _, u, r in results] == [
        (r.finish_reason, len(r.token_ids)) for r in refs]
    after = metrics(server.url)
    key = "llmserve:iteration_num_requests_bucket{le=\"1.0\"}"
    count = "llmserve:iteration_num_requests_count"
    multi = lambda m: m[count] - m[key]  # noqa: E731 - steps with more than one request
    assert multi(after) > multi(before)
    assert after["llmserve:max_batch_size"] > 1


def _running_zero(baseline_kv: float):
    return lambda m: (m["llmserve:num_requests_running"] == 0
                      and m["llmserve:num_requests_waiting"] == 0
                      and m["llmserve:kv_cache_usage_perc"] == baseline_kv)


def test_stream_disconnect_aborts_and_frees_kv(server):
    base = wait_metrics(server.url, lambda m: m["llmserve:num_requests_running"] == 0)
    baseline_kv = base["llmserve:kv_cache_usage_perc"]
    aborted = 'llmserve:request_success_total{finished_reason="abort"}'
    body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # got generated text: now hang up mid-stream
    m = wait_metrics(server.url, _running_zero(baseline_kv))
    assert m[aborted] == base[aborted] + 1


def test_non_streaming_disconnect_aborts(server):
    base = wait_metrics(server.url, lambda m: m["llmserve:num_requests_running"] == 0)
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    wait_metrics(server.url, lambda m: m["llmserve:num_requests_running"] == 1)
    sock.close()
    wait_metrics(server.url, _running_zero(base["llmserve:kv_cache_usage_perc"]))


def test_metrics_have_the_vllm_names(server):
    m = metrics(server.url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count"):
        assert "llmserve:" + name in m, name
    assert m['llmserve:request_success_total{finished_reason="length"}'] > 0
    assert m["llmserve:time_to_first_token_seconds_count"] > 0


def test_prefix_cache_hits_show_in_usage_and_metrics(server, client):
    before = metrics(server.url)
    system = "You are a terse assistant that answers in one word. " * 12
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system},
                               {"role": "user", "content": "Colour of grass?"}],
        max_tokens=2, temperature=0)
    second = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system},
                               {"role": "user", "content": "Colour of snow?"}],
        max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details is not None
    assert cached >= 100 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    after = metrics(server.url)
    hits = "llmserve:prefix_cache_hits_total"
    assert after[hits] - before.get(hits, 0) >= cached
    assert after["llmserve:prefix_cache_queries_total"] > before.get(
        "llmserve:prefix_cache_queries_total", 0)


def test_n_choices_equal_separate_seeded_requests(client):
    kw = dict(model=MODEL, prompt="A haiku about autumn:", max_tokens=8, temperature=1.0)
    resp = client.completions.create(n=3, seed=11, **kw)
    for i, choice in enumerate(resp.choices):
        alone = client.completions.create(n=1, seed=11 + i, **kw)
        assert choice.text == alone.choices[0].text, i
    assert resp.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counts once


def test_invalid_unicode_prompt_is_a_400(server):
    raw = f'{{"model": "{MODEL}", "prompt": "ab\\udc00cd", "max_tokens": 2}}'
    for path in ("/v1/completions", "/tokenize"):
        r = httpx.post(server.url + path, content=raw,
                       headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert "not valid Unicode" in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions",
                    json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0}, timeout=60)
    assert ok.status_code == 200

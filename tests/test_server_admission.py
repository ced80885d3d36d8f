"""Server hardening (issue 20, items 2, 4, 5) against a real server process on loopback:

- admission is exact under a burst: with ``--max-num-seqs 4 --max-waiting-requests 8``
  exactly 12 of 80 concurrent long requests are admitted (streamed, not streamed, chat),
  the rest get 503 with ``Retry-After``; hanging up releases the slots;
- a 4 MB body does not block the event loop: ``/health`` answers while it is in flight;
  a body over ``--max-request-body-bytes`` is a 413 (by Content-Length and chunked);
  without the key a 4 MB ``/tokenize`` is a 401;
- a prompt that ends inside a character: the first output token completes it, streamed
  or not; logprobs give the raw bytes (chat ``bytes``, completions ``bytes:\\xNN``).

The long requests (2000 tokens, ignore_eos) cannot finish while a burst is counted, so
the counts do not depend on timing. Waits are bounded polls.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket

import pytest

from tests.test_server import MODEL, PROMPT, start_server, stop_server, wait_metrics
from tests.test_token_bytes import ISSUE_PROMPT, oracle_bytes, pending_bytes

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model

KEY = "sk-admission"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_NUM_SEQS, MAX_WAITING = 4, 8
ADMITTED = MAX_NUM_SEQS + MAX_WAITING
BURST = 80
BODY_LIMIT = 6 * 1024 * 1024
LONG = {"model": MODEL, "max_tokens": 2000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    server = start_server("--api-key", KEY, "--allow-unauthenticated-metrics",
                          "--max-num-seqs", str(MAX_NUM_SEQS),
                          "--max-waiting-requests", str(MAX_WAITING),
                          "--max-request-body-bytes", str(BODY_LIMIT))
    yield server
    stop_server(server)


def _idle(m):
    return (m["llmserve:num_requests_running"] == 0
            and m["llmserve:num_requests_waiting"] == 0)


def _in_engine(m):
    return m["llmserve:num_requests_running"] + m["llmserve:num_requests_waiting"]


async def _send(client: httpx.AsyncClient, url: str, path: str, body: dict,
                stream: bool) -> int:
    """POST; returns the status. An admitted request is held open (a stream is read,
    a plain request waits for its answer) until cancelled."""
    if stream:
        async with client.stream("POST", url + path, json={**body, "stream": True},
                                 headers=AUTH) as r:
            if r.status_code != 200:
                await r.aread()
                _check_503(r)
                return r.status_code
            async for _ in r.aiter_lines():
                pass
            return 200
    r = await client.post(url + path, json=body, headers=AUTH)
    if r.status_code != 200:
        _check_503(r)
    return r.status_code


def _check_503(r) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == 503 and err["type"] == "service_unavailable_error"
    assert "--max-waiting-requests" in err["message"]


def _burst(url: str, kinds: list[tuple[str, dict, bool]]) -> tuple[int, int, float]:
    """Send len(kinds) requests at once; returns (#admitted, #503, engine peak seen)."""
    async def run():
        limits = httpx.Limits(max_connections=BURST + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            tasks = [asyncio.create_task(_send(client, url, path, body, stream))
                     for path, body, stream in kinds]
            # every refused request answers; the admitted ones stay in flight
            while sum(t.done() for t in tasks) < len(kinds) - ADMITTED:
                await asyncio.wait([t for t in tasks if not t.done()],
                                   return_when=asyncio.FIRST_COMPLETED)
            m = await asyncio.to_thread(wait_metrics, url,
                                        lambda m: _in_engine(m) == ADMITTED)
            # nothing more is admitted: the engine holds exactly max_num_seqs + waiting
            assert m["llmserve:num_requests_running"] == MAX_NUM_SEQS
            assert m["llmserve:num_requests_waiting"] == MAX_WAITING
            refused = [t.result() for t in tasks if t.done()]
            still = sum(not t.done() for t in tasks)
            for t in tasks:
                t.cancel()  # hang up: the server aborts them and frees their slots
            await asyncio.gather(*tasks, return_exceptions=True)
            return still, refused, _in_engine(m)

    still, refused, peak = asyncio.run(run())
    assert set(refused) == {503}, refused
    wait_metrics(url, _idle)
    return still, len(refused), peak


@pytest.mark.parametrize("mode", ["stream", "plain", "mixed"])
def test_burst_admits_exactly_max_num_seqs_plus_max_waiting(server, mode):
    completion = ("/v1/completions", {**LONG, "prompt": PROMPT})
    chat = ("/v1/chat/completions", {**LONG, "messages": [{"role": "user", "content": "Hi"}]})
    if mode == "stream":
        kinds = [(*completion, True)] * BURST
    elif mode == "plain":
        kinds = [(*completion, False)] * BURST
    else:
        kinds = [(*(chat if i % 2 else completion), i % 3 != 0) for i in range(BURST)]
    admitted, refused, peak = _burst(server.url, kinds)
    assert (admitted, refused, peak) == (ADMITTED, BURST - ADMITTED, ADMITTED)


def test_n_counts_every_choice_and_too_many_is_a_400(server):
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 1, "n": ADMITTED + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    ok = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=300,
                    json={"prompt": PROMPT, "max_tokens": 1, "n": ADMITTED})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == ADMITTED


def _raw_post(url: str, path: str, body: bytes, headers: dict[str, str]) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=300)
    head = "".join(f"{k}: {v}\r\n" for k, v in {
        "Host": host, "Content-Type": "application/json", "Content-Length": str(len(body)),
        "Connection": "close", **headers}.items())
    sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + body)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    with sock:
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_health_answers_while_a_4mb_prompt_is_in_flight(server):
    big = ("The quick brown fox jumps over the lazy dog. " * 100_000)[:4_000_000]
    body = json.dumps({"model": MODEL, "prompt": big, "max_tokens": 1}).encode()
    sock = _raw_post(server.url, "/v1/completions", body, AUTH)  # whole body sent
    assert httpx.get(server.url + "/health", timeout=300).status_code == 200
    readable, _, _ = select.select([sock], [], [], 0)
    assert not readable  # /health answered while the big prompt was still tokenized
    status, answer = _read_response(sock)
    assert status == 400 and "maximum context length" in answer.decode(), answer[:300]


def test_unauthenticated_big_tokenize_is_a_401_without_reading_it(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x" * 4_000_000}, timeout=300)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=AUTH)
    assert r.status_code == 200 and r.json()["count"] > 0


def test_body_over_the_limit_is_a_413_before_parsing(server):
    big = b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big, timeout=300,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == 413 and str(BODY_LIMIT) in err["message"]

    def chunked():  # no Content-Length: counted while it arrives
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]
    r = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=300,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text
    ok = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=300,
                    json={"prompt": PROMPT, "max_tokens": 1})
    assert ok.status_code == 200


def test_prompt_ending_inside_a_character(server, llm_fp32):
    """The issue's prompt ("I love 🎉" + 3 bytes of a 4-byte character): the output text
    is the bytes from that character's start on, as the offline engine's tokens give
    them (oracle: the GPT-2 byte alphabet), streamed or not, and in the logprobs."""
    from llmserve import SamplingParams

    tok = llm_fp32.get_tokenizer()
    tail = oracle_bytes(tok, ISSUE_PROMPT)
    tail = tail[len(tail) - pending_bytes(tail):]
    assert tail == b"\xf0\x9f\x90"
    ref = llm_fp32.generate([{"prompt_token_ids": ISSUE_PROMPT}],
                            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)
    out_ids = list(ref[0].outputs[0].token_ids)
    for max_tokens in (1, 6):
        raw = tail + oracle_bytes(tok, out_ids[:max_tokens])
        expected = raw[:len(raw) - pending_bytes(raw)].decode("utf-8", errors="replace")
        assert expected  # the first token completes the character
        body = {"model": MODEL, "prompt": ISSUE_PROMPT, "max_tokens": max_tokens,
                "temperature": 0, "logprobs": 1, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=300)
        choice = r.json()["choices"][0]
        assert choice["text"] == expected
        tokens = choice["logprobs"]["tokens"]
        assert len(tokens) == max_tokens
        for tid, t in zip(out_ids, tokens):
            b = oracle_bytes(tok, [tid])
            try:
                assert t == b.decode("utf-8")
            except UnicodeDecodeError:
                assert t == "bytes:" + "".join(f"\\x{x:02x}" if x >= 0x80 else chr(x)
                                               for x in b)
        with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=300,
                          json={**body, "stream": True}) as s:
            pieces = [json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(pieces) == expected
    # chat: the bytes field of every logprob entry is the token's raw bytes
    chat = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Write one emoji: 🐨"}],
        "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    joined = b"".join(bytes(e["bytes"]) for e in content)
    text = chat["choices"][0]["message"]["content"]
    assert joined[:len(text.encode())].decode("utf-8") == text
    for entry in content + [t for e in content for t in e["top_logprobs"]]:
        b = bytes(entry["bytes"])
        assert "\ufffd" not in entry["token"]
        assert entry["token"] == b.decode("utf-8", errors="backslashreplace")

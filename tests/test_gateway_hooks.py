"""The gateway's hook points (:mod:`llmserve.gateway.hooks`) with small real hooks,
the app served in-process by uvicorn in front of a real ``llmserve serve`` worker and
a real ``redis-server``: one audit record per request (rejected and aborted ones too),
and an output moderator's cut ends a stream with ``finish_reason: "content_filter"``.
Waits are bounded polls."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("redis")
pytest.importorskip("yaml")

from llmserve.gateway.hooks import InputVerdict, OutputStep  # noqa: E402
from tests.gateway_procs import MASTER_KEY, start_redis  # noqa: E402
from tests.test_gateway import ADMIN, HI, MODEL_A, bearer, poll  # noqa: E402
from tests.test_server import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def worker():
    server = start_server("--served-model-name", MODEL_A)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def redis_proc():
    redis = start_redis()
    yield redis
    redis.stop()


class ListAudit:
    def __init__(self) -> None:
        self.records: list[dict] = []

    async def record(self, record: dict) -> None:
        json.dumps(record)  # records must be JSON-serializable
        self.records.append(record)


class CutAfterChars:
    """Lets the first ``limit`` characters of each choice through, then stops it."""

    def __init__(self, limit: int) -> None:
        self.limit, self.sent = limit, {}

    def feed(self, choice: int, text: str) -> OutputStep:
        sent = self.sent.get(choice, 0)
        room = max(self.limit - sent, 0)
        self.sent[choice] = sent + min(len(text), room)
        if len(text) > room:
            return OutputStep(text[:room], stop=True, verdicts=[{"check": "cut"}])
        return OutputStep(text)

    def finish(self, choice: int) -> OutputStep:
        return OutputStep("")


class WordPipeline:
    async def check_input(self, body, ctx) -> InputVerdict:
        if "forbidden" in json.dumps(body.get("messages")):
            return InputVerdict("block", message="blocked: forbidden word",
                                verdicts=[{"check": "word", "flagged": True}])
        return InputVerdict(verdicts=[{"check": "word", "flagged": False}])

    def output_moderator(self, ctx) -> CutAfterChars:
        return CutAfterChars(5)


@pytest.fixture(scope="module")
def hooked(worker, redis_proc):
    import uvicorn

    from llmserve.gateway.app import build_app
    from llmserve.gateway.config import GatewayConfig

    audit = ListAudit()
    app = build_app(GatewayConfig(upstreams=(worker.url,), redis_url=redis_proc.url,
                                  master_key=MASTER_KEY), audit=audit, safety=WordPipeline())
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert poll(lambda: _healthy(url), timeout=30)
    yield url, audit
    server.should_exit = True
    thread.join(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_audit_record_per_request_and_streamed_output_cut(hooked):
    url, audit = hooked
    base = {"model": MODEL_A, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    r = httpx.post(url + "/v1/chat/completions", headers=ADMIN, timeout=120, json={
        **base, "messages": [{"role": "user", "content": "a forbidden thing"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "content_filter"

    r = httpx.post(url + "/v1/chat/completions", headers=ADMIN, timeout=120,
                   json={**base, "messages": HI})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "content_filter"  # 8 tokens > 5 characters
    assert len(choice["message"]["content"]) == 5

    pieces, finish = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", headers=ADMIN, timeout=120,
                      json={**base, "messages": HI, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    pieces.append(c["delta"].get("content") or "")
                    finish = c.get("finish_reason") or finish
    assert finish == "content_filter"
    assert "".join(pieces) == choice["message"]["content"]  # greedy: the same 5 characters

    with httpx.Client(timeout=120) as client, client.stream(
            "POST", url + "/v1/chat/completions", headers=ADMIN,
            json={**base, "max_tokens": 1000, "messages": HI, "stream": True}) as s:
        lines = s.iter_lines()
        assert next(lines).startswith("data: ")  # then the client goes away

    recs = poll(lambda: audit.records if len(audit.records) >= 4 else None, timeout=30)
    assert recs is not None and len(recs) == 4
    time.sleep(0.5)
    assert len(audit.records) == 4  # exactly one record per request
    by_outcome = [(x["status"], x["outcome"], x["stream"]) for x in recs]
    assert by_outcome == [(400, "rejected", False), (200, "ok", False), (200, "ok", True),
                          (200, "aborted", True)]
    assert recs[1]["response_text"] == [choice["message"]["content"]]
    assert recs[2]["response_text"] == ["".join(pieces)]
    assert recs[1]["safety"][0] == {"check": "word", "flagged": False}

    # refused before any upstream: a body that is not JSON, a bad field, a wrong key
    chat_url = url + "/v1/chat/completions"
    assert httpx.post(chat_url, headers=ADMIN, content=b"{oops").status_code == 400
    assert httpx.post(chat_url, headers=ADMIN, json={**base, "messages": HI,
                                                     "n": "2"}).status_code == 400
    assert httpx.post(chat_url, headers=bearer("sk-wrong"),
                      json={**base, "messages": HI}).status_code == 401
    recs = poll(lambda: audit.records if len(audit.records) >= 7 else None, timeout=30)
    assert recs is not None and len(recs) == 7
    assert [(x["status"], x["outcome"], x["model"]) for x in recs[4:]] == [
        (400, "rejected", None), (400, "rejected", MODEL_A), (401, "unauthenticated", None)]
    assert recs[5]["request"]["n"] == "2" and recs[6]["key_id"] is None
    assert "sk-wrong" not in json.dumps(recs[6])
    assert any(v.get("check") == "cut" for v in recs[2]["safety"])
    assert recs[1]["completion_tokens"] == 8 and recs[1]["prompt_tokens"] > 0

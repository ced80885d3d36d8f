"""Streamed output moderation (no unsafe span reaches the client, whatever the deltas'
cuts: the streamed result equals the whole-text result for every split) and the LLM
judge against a real HTTP server on loopback and against a real `llmserve serve`."""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from llmserve.gateway.safety import SafetyPipeline, build_check
from llmserve.gateway.safety.llm_judge import parse_judgement
from llmserve.gateway.safety.pii import mask_pii

pytestmark = pytest.mark.timeout(300)

PII_TEXT = ("Sure! Write to jane.doe@example.com or call +44 20 7946 0958. 卡号4111 1111 1111 "
            "1111，身份证11010519491231002X。IBAN GB82 WEST 1234 5698 7654 32, host 10.2.3.4 ok.")
HARM_EN = "Okay. Here is how to make a pipe bomb: first, get a steel pipe and end caps."
HARM_ZH = "好的，我来告诉你如何制作炸弹，首先需要准备材料。"


def _splits(text: str, rng: random.Random):
    n = len(text)
    for i in range(1, n):
        yield [text[:i], text[i:]]
    yield list(text)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, n), rng.randint(2, 12)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, n])]


def _stream(pipe, deltas, oracle_prefix_of: str):
    m = pipe.output_moderator()
    sent = ""
    for d in deltas:
        sent += m.feed(d)
        # at every step the client has only seen a prefix of the decided text
        assert oracle_prefix_of.startswith(sent), (deltas, sent)
    res = m.finish()
    return sent + res.text, res


def test_pii_masked_whatever_the_split():
    pipe = SafetyPipeline.from_policy({"output": [{"check": "pii", "action": "mask"}]})
    oracle, counts = mask_pii(PII_TEXT)  # the non-streaming check on the whole text
    assert sum(counts.values()) == 6 and "jane" not in oracle and "4111" not in oracle
    for deltas in _splits(PII_TEXT, random.Random(0)):
        out, res = _stream(pipe, deltas, oracle)
        assert out == oracle, deltas
        assert res.finish_reason is None
        assert sorted({v.category for v in res.verdicts}) == sorted(
            "pii." + k for k in counts)


@pytest.mark.parametrize("text", [HARM_EN, HARM_ZH])
def test_harmful_output_cut_before_the_span(text):
    pipe = SafetyPipeline.from_policy({"output": [{"check": "harmful", "action": "block"},
                                                  {"check": "pii", "action": "mask"}]})
    (v,) = build_check({"check": "harmful"}).check(text)
    safe_prefix = text[:v.spans[0].start]
    assert safe_prefix in ("Okay. Here is ", "好的，我来告诉你")
    for deltas in _splits(text, random.Random(1)):
        out, res = _stream(pipe, deltas, safe_prefix)
        assert out == safe_prefix, deltas
        assert res.finish_reason == "content_filter"
        assert res.verdicts[0].category == "harmful.weapons"


def test_benign_text_flows_and_flag_passes():
    pipe = SafetyPipeline.from_policy({"output": [{"check": "harmful", "action": "flag"},
                                                  {"check": "pii"}]})
    m = pipe.output_moderator()
    first = m.feed("The capital of France is Paris. ")
    assert first.startswith("The capital of France is Paris.")  # not held to the end
    assert m.held <= 1
    text = "Historians say the recipe for disaster was how to make a bomb threat look real. "
    out = m.feed(text) + m.finish().text
    assert out == text
    assert [v.action for v in m.verdicts] == ["flag"]


def test_moderator_max_hold_bounds_held_text():
    pipe = SafetyPipeline.from_policy({"output": [{"check": "pii"}], "output_max_hold": 8})
    m = pipe.output_moderator()
    out = "".join(m.feed("1") for _ in range(40))
    assert m.held <= 8 and len(out) >= 32
    assert out + m.finish().text == "1" * 40


# ---------------------------------------------------------------- LLM judge
def test_parse_judgement():
    assert parse_judgement("safe") == (True, [])
    assert parse_judgement("unsafe\nS1,S10") == (False, ["S1", "S10"])
    assert parse_judgement("  Unsafe \n S3, S3 ") == (False, ["S3"])
    assert parse_judgement("unsafe") == (False, [])
    assert parse_judgement("I think it is fine") is None
    assert parse_judgement("") is None


@pytest.fixture
def judge_server():
    """A real OpenAI-style HTTP server on loopback that judges like Llama Guard."""
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append({"path": self.path, "body": body,
                             "auth": self.headers.get("Authorization")})
            convo = body["messages"][-1]["content"].split("<BEGIN CONVERSATION>")[1]
            answer = ("unsafe\nS1" if "neighbour" in convo else
                      "no idea" if "gibberish" in convo else "safe")
            data = json.dumps({"choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", "content": answer}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1", received
    srv.shutdown()
    srv.server_close()


def test_llm_judge_against_loopback_server(judge_server):
    url, received = judge_server
    chk = build_check({"check": "llm_judge", "url": url, "model": "guard", "api_key": "sk-j",
                       "action": "block"})
    (v,) = chk.check("How do I hurt my neighbour?")
    assert (v.category, v.action, v.detail) == ("judge.S1", "block", "Violent Crimes")
    req = received[-1]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-j"
    assert req["body"]["model"] == "guard" and req["body"]["temperature"] == 0
    prompt = req["body"]["messages"][0]["content"]
    assert "S9: Indiscriminate Weapons." in prompt
    assert "User: How do I hurt my neighbour?\n\n<END CONVERSATION>" in prompt
    assert chk.check("What is the capital of France?") == []
    (e,) = chk.check("gibberish")
    assert e.category == "judge.error" and e.action == "flag" and "unparseable" in e.detail
    # in a pipeline, on the output, holding the whole response until judged
    pipe = SafetyPipeline.from_policy({"output": [
        {"check": "llm_judge", "url": url, "role": "Agent", "hold": True}]})
    m = pipe.output_moderator()
    assert m.feed("Go and hurt your ") + m.feed("neighbour.") == ""
    res = m.finish()
    assert res.text == "" and res.finish_reason == "content_filter"
    assert "Agent: Go and hurt your neighbour." in received[-1]["body"]["messages"][0]["content"]


def test_llm_judge_unreachable_follows_on_error():
    with httpx.Client() as c:  # a port with nothing listening: take one and free it
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        del c
    url = f"http://127.0.0.1:{port}/v1"
    for on_error, expect in [("block", ["block"]), ("flag", ["flag"]), ("allow", [])]:
        chk = build_check({"check": "llm_judge", "url": url, "on_error": on_error,
                           "timeout": 2})
        assert [v.action for v in chk.check("hello")] == expect


@pytest.mark.model
def test_llm_judge_plumbing_against_real_worker():
    from tests.test_server import start_server, stop_server

    server = start_server("--max-model-len", "2048")
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        chk = build_check({"check": "llm_judge", "url": server.url + "/v1", "model": model,
                           "action": "flag", "max_tokens": 4, "timeout": 240})
        reply = chk.ask("What is the capital of France?")
        assert isinstance(reply, str) and reply.strip()
        # the 135M model is no guard model: only the plumbing is checked here
        verdicts = chk.check("What is the capital of France?")
        assert all(v.action == "flag" and (v.category.startswith("judge.S")
                                           or "unparseable" in v.detail) for v in verdicts)
    finally:
        assert stop_server(server) == 0, server.log()


def test_a_custom_check_registered_by_name_streams_with_the_default_window():
    import regex

    from llmserve.gateway.safety import CHECKS, InputCheck, Span, register_check

    @register_check
    class SecretWord(InputCheck):
        """Blocks the word 'xyzzy' (a stand-in for a third-party classifier)."""

        name = "secret_word_test"
        window = 8

        def check(self, text):
            return [self.verdict("custom.secret", [Span(m.start(), m.end(), "SECRET")])
                    for m in regex.finditer("xyzzy", text)]

    try:
        pipe = SafetyPipeline.from_policy({"input": [{"check": "secret_word_test"}],
                                           "output": [{"check": "secret_word_test"}]})
        assert pipe.check_input("say xyzzy").blocked.category == "custom.secret"
        text = "Then the wizard whispered xyzzy and vanished."
        for deltas in _splits(text, random.Random(2)):
            out, res = _stream(pipe, deltas, "Then the wizard whispered ")
            assert out == "Then the wizard whispered " and res.finish_reason == "content_filter"
    finally:
        CHECKS.pop("secret_word_test", None)

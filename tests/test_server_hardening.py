"""Server hardening against a real ``llmserve serve --trust-request-chat-template``
process on loopback: request chat templates are sandboxed and bounded (errors are 400s,
a slow template stalls no other request), error messages name request fields and
never our internals, a request the KV cache can never hold is refused up front, and
the published ``/openapi.json`` matches what the server answers (schemathesis'
conformance checks, a bounded number of examples). The refusal of request templates
without the flag is in ``tests/test_server.py`` (ERROR_CASES).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.test_server import MODEL, start_server, stop_server

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model

MAX_MODEL_LEN = 96
KV_TOKENS = 64  # --kv-cache-memory 4MiB: 5 blocks of 16 at 46080 B/token, one reserved
HI = [{"role": "user", "content": "hi"}]
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
DEEP: list = []
for _ in range(80):
    DEEP = [DEEP]
INTERNALS = ("transformers", "llmserve", "jinja2", "Traceback", "site-packages", "File \"")


@pytest.fixture(scope="module")
def server():
    server = start_server("--trust-request-chat-template", "--max-model-len",
                          str(MAX_MODEL_LEN), "--kv-cache-memory", "4MiB")
    yield server
    assert stop_server(server) == 0, server.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _chat(server, **body):
    body = {"messages": HI, "max_tokens": 1, "temperature": 0, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)


def test_trusted_request_template_is_applied(server, client):
    template = "HELLO {{ messages[0]['content'] }}"
    tokens = httpx.post(server.url + "/tokenize", json={
        "prompt": "HELLO hi", "add_special_tokens": False}).json()["tokens"]
    for extra in ({"chat_template": template},
                  {"chat_template_kwargs": {"chat_template": template}}):
        resp = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                              temperature=0, extra_body=extra)
        # the completion saw exactly the rendered text (no special tokens around it)
        assert resp.usage.prompt_tokens == len(tokens)
    kw = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=1, temperature=0,
        extra_body={"chat_template": "{{ greeting }} {{ messages[0]['content'] }}",
                    "chat_template_kwargs": {"greeting": "HELLO"}})
    assert kw.usage.prompt_tokens == len(tokens)


TEMPLATE_ERRORS = [
    # (request fields, param, substring of the message)
    ({"chat_template": "{{ 1/0 }}"}, "chat_template", "ZeroDivisionError"),
    ({"chat_template_kwargs": {"chat_template": "{% macro f() %}{{ f() }}{% endmacro %}"
                                                "{{ f() }}"}},
     "chat_template_kwargs", "recursed too deeply"),
    ({"chat_template": "{{ 'a b ' * 2000000 }}"}, "chat_template", "size limit"),
    ({"chat_template": "{{ x"}, "chat_template", "not valid Jinja"),
    ({"chat_template": "{{ ''.__class__.__mro__ }}"}, "chat_template", "sandbox forbids"),
    ({"chat_template": "{{ raise_exception('no tools here') }}"}, "chat_template",
     "no tools here"),
    ({"chat_template": "x", "chat_template_kwargs": {"chat_template": "y"}},
     "chat_template_kwargs", "once"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     "request field add_generation_prompt"),
    ({"continue_final_message": True}, "messages", "cannot both be true"),
]


@pytest.mark.parametrize("fields,param,needle", TEMPLATE_ERRORS)
def test_template_errors_are_400s_naming_the_field(server, fields, param, needle):
    r = _chat(server, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert not any(word in err["message"] for word in INTERNALS), err
    assert _chat(server).status_code == 200  # and the server goes on
    assert "Traceback" not in server.log()


def test_slow_template_is_stopped_and_stalls_nothing(server):
    """A template that loops for ever is stopped by the render time limit (a 400); it
    renders off the event loop, so requests sent after it are answered before it."""

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            slow = asyncio.create_task(c.post("/v1/chat/completions", json={
                "messages": HI, "max_tokens": 1, "chat_template": LOOP}))
            for _ in range(3):
                assert (await c.get("/v1/models")).status_code == 200
                r = await c.post("/tokenize", json={"messages": HI})
                assert r.status_code == 200
            assert not slow.done()  # still rendering while the others were answered
            return await slow

    r = asyncio.run(main())
    assert r.status_code == 400 and "took longer than" in r.json()["error"]["message"], r.text


BAD_REQUESTS = [
    # (path, body, param)
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"tools": 1}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": 5},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"deep": DEEP}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "x"}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": HI, "tools": "all"}, "tools"),
    ("/v1/chat/completions", {"messages": HI, "chat_template": 3}, "chat_template"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
def test_error_messages_name_fields_not_internals(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert not any(word in err["message"] for word in INTERNALS), err
    assert err["param"] == param, err


def test_kv_cache_limit_is_refused_up_front(server, client):
    """prompt + max_tokens within max_model_len but over the whole KV cache: a 400
    saying so, instead of a completion cut short with finish_reason "length"."""
    prompt = " ".join(["word"] * 56)  # long prompts leave little room: cheap to fill
    prompt_len = len(httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()[
        "tokens"])
    room = KV_TOKENS - prompt_len
    assert 0 < room < 16 and prompt_len + room + 1 <= MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError, match=f"KV cache holds {KV_TOKENS} tokens"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=room + 1)
    ok = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=room,
                                   extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == room and ok.choices[0].finish_reason == "length"
    # without max_tokens, a chat completion may use what the KV cache holds
    messages = [{"role": "user", "content": " ".join(["word"] * 30)}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.total_tokens == KV_TOKENS and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens < 16


def test_health_and_schema_agree(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.content == b""
    schema = httpx.get(server.url + "/openapi.json").json()
    assert schema["paths"]["/health"]["get"]["responses"]["200"].get("content") is None
    for path, op in (("/v1/completions", "post"), ("/v1/chat/completions", "post")):
        responses = schema["paths"][path][op]["responses"]
        assert "422" not in responses
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse")
    req = schema["components"]["schemas"]
    assert req["CompletionRequest"]["properties"]["prompt"]["anyOf"][0]["minLength"] == 1
    assert req["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    for body, field in (({"prompt": ""}, "prompt"), ({"messages": []}, "messages")):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_schemathesis_conformance(server):
    """schemathesis (property-based, from /openapi.json): every answer has a documented
    status code and content type and matches its documented schema; no 5xx. Bounded:
    a few examples per operation, and generation clamped to 1 token and 1 choice."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=8, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case):
            _clamp(case.body)
            case.call_and_validate(checks=checks, timeout=120)

        try:
            run()
        except Exception as e:  # collect every operation's failure, then report
            failures.append(f"{operation.label}: {e}")
    assert not failures, "\n\n".join(failures)


def _clamp(body):
    """Keep generated requests cheap: one token, one choice (a schema-valid body stays
    schema-valid)."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > 1:
            body[key] = 1
    if "messages" in body and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = 1
    if "prompt" in body and body.get("max_tokens") is None:  # 16 by default, or all room
        body["max_tokens"] = 1
    if isinstance(body.get("n"), int) and body["n"] > 1:
        body["n"] = 1
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 1:
        body["min_tokens"] = 1

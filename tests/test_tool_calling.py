"""Tool calling through a real server with the official ``openai`` client, streamed and
not: ``tool_choice`` named and ``required`` (constrained by the function schemas, so the
default 135M model calls them reliably), ``auto`` read by the hermes parser (the model
is steered into the hermes format with ``guided_regex`` so the parser path is exercised
on real output), ``none``, ``parallel_tool_calls``, a tool-result turn, and the errors.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.test_server import MODEL, start_server, stop_server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

pytestmark = pytest.mark.model

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}},
               "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                          "Weather in a city", "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description":
                                          "Time in a zone", "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_RE = (r'I will check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def client():
    srv = start_server()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    assert stop_server(srv) == 0, srv.log()


def _check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        if names is not None:
            assert c.function.name in names


def _stream_calls(stream):
    """Accumulate streamed deltas as OpenAI clients do (by tool-call index)."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            slot = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = t.id or slot["id"]
            if t.function is not None:
                slot["name"] += t.function.name or ""
                slot["arguments"] += t.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_named_and_required_tool_choice(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice=named, max_tokens=30, temperature=0.8,
                                       seed=1)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    _check_calls(msg.tool_calls, {"get_time"})
    # one call each (parallel_tool_calls=false: maxItems 1), so the outputs stay short
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=60,
                                       temperature=1.0, seed=0, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(r.choices[0].message.tool_calls) == 1
    _check_calls(r.choices[0].message.tool_calls)
    content, calls, finish = _stream_calls(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60,
        temperature=0.8, seed=5, stream=True, parallel_tool_calls=False))
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    for c in calls:
        assert c["id"].startswith("call_")
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_auto_tool_choice_parses_hermes_output(client):
    extra = {"guided_regex": HERMES_RE}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60,
                                       temperature=0.8, seed=2, extra_body=extra)
    msg = r.choices[0].message
    assert msg.content == "I will check."
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(msg.tool_calls, {"get_weather"})
    content, calls, finish = _stream_calls(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.8, seed=2,
        stream=True, extra_body=extra))
    assert "<tool" not in content and content.strip() == "I will check."
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == json.loads(msg.tool_calls[0].function.arguments)
    # tool_choice none: the same text stays content
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60,
                                       temperature=0.8, seed=2, tool_choice="none",
                                       extra_body=extra)
    assert re.fullmatch(HERMES_RE, r.choices[0].message.content)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"


def test_tool_result_turn_and_errors(client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": '
                                                             '"celsius"}'}}
    msgs = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    base = client.base_url.copy_with(path="/v1/chat/completions")
    for body, param in (({"tool_choice": "required"}, "tool_choice"),  # no tools
                        ({"tools": TOOLS, "tool_choice": {"type": "function",
                                                          "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tools": [{"type": "function"}]}, "tools"),
                        ({"tools": TOOLS, "tool_choice": "required",
                          "guided_regex": "a"}, "tool_choice")):
        resp = httpx.post(str(base), json={"model": MODEL, "messages": ASK, **body},
                          timeout=60)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] == param, (body, resp.text)

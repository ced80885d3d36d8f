"""Tool-call parsers (no model): each family's format, whole and streamed in every
possible split, and the message preparation for templates without tool support."""

from __future__ import annotations

import json

import pytest

from llmserve.entrypoints.openai.tool_parsers import (
    ConstrainedToolCalls,
    StreamingToolCalls,
    get_tool_parser,
    tool_parser_names,
)
from llmserve.entrypoints.openai.tools import constrained_output, prepare_messages

WEATHER = {"city": "Paris", "unit": "celsius"}
CASES = {
    "hermes": ("Let me check.\n<tool_call>\n" + json.dumps(
        {"name": "get_weather", "arguments": WEATHER}) + "\n</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>', "Let me check."),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": '
                    + json.dumps(WEATHER) + '}; {"name": "get_time", "parameters": '
                    '{"tz": "CET"}}', None),
    "mistral": ("[TOOL_CALLS] [" + json.dumps({"name": "get_weather", "arguments": WEATHER})
                + ', {"name": "get_time", "arguments": {"tz": "CET"}}]', None),
}


def _stream(parser, text: str, cuts: list[int], max_calls=None):
    st = StreamingToolCalls(parser, max_calls)
    content, calls, prev = "", [], 0
    for cut in [*cuts, len(text)]:
        c, new = st.feed(text[prev:cut])
        content, calls, prev = content + c, calls + new, cut
    c, new = st.finish()
    return content + c, calls + new


@pytest.mark.parametrize("name", sorted(CASES))
def test_parsers_whole_and_streamed(name):
    text, content = CASES[name]
    parser = get_tool_parser(name)
    got_content, calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", WEATHER), ("get_time", {"tz": "CET"})]
    for cut in range(1, len(text)):  # every split into two deltas, and char by char
        s_content, s_calls = _stream(parser, text, [cut])
        assert [(c.name, c.arguments) for c in s_calls] == [(c.name, c.arguments) for c in calls]
        assert s_content.strip() == (content or "")
    s_content, s_calls = _stream(parser, text, list(range(1, len(text))), max_calls=1)
    assert [c.name for c in s_calls] == ["get_weather"]
    assert len({c.id for c in calls}) == len(calls)


def test_no_calls_is_content_and_markers_are_held_back():
    hermes = get_tool_parser("hermes")
    text = "Paris is sunny. a < b and <tool is not a tag"
    assert hermes.extract(text) == (text, [])
    content, calls = _stream(hermes, text, list(range(1, len(text))))
    assert content == text and not calls
    st = StreamingToolCalls(hermes)
    assert st.feed("Hi <tool_")[0] == "Hi "  # a possible marker start is held back
    # a broken call stays content rather than vanishing
    broken = "ok <tool_call>{not json</tool_call>"
    assert hermes.extract(broken) == (broken, [])
    assert _stream(hermes, broken, [5, 12])[0] == broken
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("nope")
    assert {"hermes", "llama3_json", "mistral"} <= set(tool_parser_names())


def test_constrained_outputs_and_schemas():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
        {"type": "function", "function": {"name": "g"}}]
    named = constrained_output(tools, "named", "f", True)
    assert named.json == tools[0]["function"]["parameters"]
    required = constrained_output(tools, "required", None, False)
    assert required.json["maxItems"] == 1 and len(required.json["items"]["anyOf"]) == 2
    assert constrained_output(tools, "auto", None, True) is None
    assert ConstrainedToolCalls("f").extract('{"x": 3}')[1][0].arguments == '{"x": 3}'
    calls = ConstrainedToolCalls(None).extract('[{"name": "g", "parameters": {}}]')[1]
    assert [(c.name, c.arguments) for c in calls] == [("g", "{}")]
    assert ConstrainedToolCalls("f").extract('{"x": ')[1] == []  # cut by max_tokens


def test_prepare_messages_for_a_template_without_tools():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    plain = prepare_messages(msgs, tools, template_reads_tools=False)
    assert plain[0]["role"] == "system" and "<tools>" in plain[0]["content"]
    assert '"arguments": {"city": "Paris"}' in plain[2]["content"]
    assert plain[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    native = prepare_messages(msgs, tools, template_reads_tools=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # no aliasing

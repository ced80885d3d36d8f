"""Tool calling on ``/v1/chat/completions`` (OpenAI API reference, "Function calling";
vLLM's ``serving_chat.py`` and ``tool_parsers``):

- ``tools``: ``[{"type": "function", "function": {"name", "description", "parameters"}}]``,
  rendered by the chat template (``tools`` variable). A template that never reads
  ``tools`` (SmolLM2's ChatML) gets them as a Hermes-style system prompt, and earlier
  assistant ``tool_calls`` / ``tool`` results as ``<tool_call>`` / ``<tool_response>``
  text, so any ChatML model sees the conversation.
- ``tool_choice``: ``"none"`` (no parsing), ``"auto"`` (the parser reads the text),
  ``"required"`` and ``{"type": "function", "function": {"name"}}``: the output is
  constrained through structured outputs, as vLLM does: named -> the function's
  ``parameters`` schema, required -> ``[{"name": <one of the tools>, "parameters":
  <its schema>}, ...]`` (``maxItems: 1`` unless ``parallel_tool_calls``).
"""

from __future__ import annotations

import contextlib
import copy
import json
from typing import Any

from llmserve.entrypoints.openai.serving_engine import bad_request
from llmserve.entrypoints.openai.tool_parsers import (
    ConstrainedToolCalls,
    ToolParser,
    get_tool_parser,
)
from llmserve.sampling_params import StructuredOutputsParams

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures "
    "within <tools></tools> XML tags. You may call one or more functions to assist with "
    "the user query. Don't make assumptions about what values to plug into functions. "
    "Here are the available tools: <tools>{tools}</tools>\nFor each function call return "
    "a json object with function name and arguments within <tool_call></tool_call> XML "
    "tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def validate_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> tuple[str, str | None]:
    """Check ``tools`` and ``tool_choice``; returns (mode, function name) with mode one
    of ``none``, ``auto``, ``required``, ``named``. Raises APIError 400 naming the field."""
    names = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': "
                              "{'name': ..., 'parameters': {...}}}", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              "tools")
        names.append(fn["name"])
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if not names:
        raise bad_request("tool_choice is only allowed when tools are specified", "tool_choice")
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        if fn["name"] not in names:
            raise bad_request(f"tool_choice names function {fn['name']!r}, which is not in "
                              f"tools ({', '.join(names)})", "tool_choice")
        return "named", fn["name"]
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': "
                      "'function', 'function': {'name': ...}}", "tool_choice")


def _parameters(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    fn = next(t["function"] for t in tools if t["function"]["name"] == name)
    return fn.get("parameters") or {"type": "object"}


def constrained_output(tools: list[dict[str, Any]], mode: str, name: str | None,
                       parallel: bool) -> StructuredOutputsParams | None:
    """The structured-output constraint of ``required`` / named tool choice, else None."""
    if mode == "named":
        return StructuredOutputsParams(json=_parameters(tools, name))
    if mode != "required":
        return None
    items = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [t["function"]["name"]]},
        "parameters": t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def output_parser(mode: str, name: str | None, default_parser: str | None) -> ToolParser | None:
    """The parser of this request's output (None: plain content)."""
    if mode in ("named", "required"):
        return ConstrainedToolCalls(name)
    if mode == "auto" and default_parser:
        return get_tool_parser(default_parser)
    return None


def prepare_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     template_reads_tools: bool) -> list[dict[str, Any]]:
    """Messages for the template: ``tool_calls[].function.arguments`` JSON text -> objects
    (templates ``tojson`` them, as vLLM passes them); for a template that does not read
    ``tools``, the Hermes system prompt and tool turns as text (see the module doc)."""
    out = []
    for msg in messages:
        msg = copy.copy(msg) if isinstance(msg, dict) else msg
        calls = msg.get("tool_calls") if isinstance(msg, dict) else None
        if isinstance(calls, list):
            msg["tool_calls"] = [_call_with_object_args(c) for c in calls]
        out.append(msg)
    if template_reads_tools or not tools:
        return out
    text_msgs = []
    for msg in out:
        if not isinstance(msg, dict):
            text_msgs.append(msg)
            continue
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            fns = [c["function"] for c in msg["tool_calls"]
                   if isinstance(c, dict) and isinstance(c.get("function"), dict)]
            blocks = "\n".join(
                "<tool_call>\n" + json.dumps({"name": fn.get("name"),
                                              "arguments": fn.get("arguments")},
                                             ensure_ascii=False) + "\n</tool_call>"
                for fn in fns)
            content = msg.get("content") or ""
            msg = {"role": "assistant", "content": (content + "\n" if content else "") + blocks}
        elif msg.get("role") == "tool":
            content = msg.get("content")
            msg = {"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"}
        text_msgs.append(msg)
    system = HERMES_SYSTEM.format(tools=json.dumps(tools, ensure_ascii=False))
    if text_msgs and isinstance(text_msgs[0], dict) and text_msgs[0].get("role") == "system" \
            and isinstance(text_msgs[0].get("content"), str):
        text_msgs[0] = {**text_msgs[0], "content": text_msgs[0]["content"] + "\n\n" + system}
    else:
        text_msgs.insert(0, {"role": "system", "content": system})
    return text_msgs


def _call_with_object_args(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        with contextlib.suppress(json.JSONDecodeError):
            fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "function": fn}

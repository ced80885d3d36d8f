"""Tool-call parsers: model output text -> (content, tool calls), whole or streamed.

A registry by name, as vLLM's ``--tool-call-parser`` (``vllm/entrypoints/openai/
tool_parsers/``); each parser reads one model family's format:

==============  ==========================================================  ==============
name            what the model writes                                        models
==============  ==========================================================  ==============
``hermes``      ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``    Qwen2.5, Hermes,
                (one block per call; text before the first is content)        ChatML models
``llama3_json`` ``{"name": .., "parameters": {..}}`` (``; `` between calls,   Llama 3.1+
                optional ``<|python_tag|>`` first)
``mistral``     ``[TOOL_CALLS] [{"name": .., "arguments": {..}}, ..]``         Mistral
==============  ==========================================================  ==============

Streaming (:class:`StreamingToolCalls`): content is passed through until a parser's
start marker appears (a suffix that could be the start of a marker is held back, so
``<tool_`` never leaks as content); from the marker on, each call is emitted as one
OpenAI ``tool_calls`` delta (index, id, type, name, whole arguments) as soon as it is
complete (hermes: its closing tag), the rest at the end of the output.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class ParsedToolCall:
    """One call: the function name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"


def _call_from_obj(obj: object, args_key: str = "arguments") -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return ParsedToolCall(obj["name"], args)


class ToolParser(ABC):
    """Reads tool calls out of model text.

    Invariants: :meth:`extract` on the whole text is the non-streamed answer; content
    is everything before the first start marker (None when empty); text that does not
    parse as calls stays content (never dropped, never a 500).
    """

    name: str = ""
    start_markers: tuple[str, ...] = ()

    def find_start(self, text: str) -> int:
        """Index where tool calls begin in ``text``, or -1."""
        hits = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return min(hits) if hits else -1

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        start = self.find_start(text)
        if start < 0:
            return text or None, []
        calls = self.parse_calls(text[start:], final=True)
        if not calls:
            return text or None, []
        return text[:start].strip() or None, calls

    @abstractmethod
    def parse_calls(self, region: str, final: bool) -> list[ParsedToolCall]:
        """Calls in ``region`` (the text from the start marker on); with ``final`` False
        only the calls already complete."""


_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(cls: type[ToolParser]) -> type[ToolParser]:
    _PARSERS[cls.name] = cls
    return cls


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    """Raises ValueError naming the known parsers."""
    if name not in _PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(tool_parser_names())}")
    return _PARSERS[name]()


@register_tool_parser
class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse_calls(self, region: str, final: bool) -> list[ParsedToolCall]:
        calls = []
        for m in self._block.finditer(region):
            if not final and not m.group(0).endswith("</tool_call>"):
                break
            try:
                call = _call_from_obj(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
        return calls


def _split_json_objects(text: str) -> list[str]:
    """Top-level ``{...}`` objects in ``text`` (string-aware brace matching)."""
    out, depth, start, in_str, esc = [], 0, -1, False, False
    for i, ch in enumerate(text):
        if in_str:
            esc = not esc and ch == "\\"
            if ch == '"' and not esc:
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                out.append(text[start:i + 1])
    return out


@register_tool_parser
class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = ("<|python_tag|>", "{")

    def find_start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(self.start_markers):  # only a call that opens the output
            return len(text) - len(stripped)
        return -1

    def parse_calls(self, region: str, final: bool) -> list[ParsedToolCall]:
        if not final:
            return []
        calls = []
        for obj in _split_json_objects(region.removeprefix("<|python_tag|>")):
            try:
                call = _call_from_obj(json.loads(obj), "parameters")
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
        return calls


@register_tool_parser
class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)

    def parse_calls(self, region: str, final: bool) -> list[ParsedToolCall]:
        if not final:
            return []
        body = region.removeprefix("[TOOL_CALLS]").strip()
        try:
            objs = json.loads(body)
        except json.JSONDecodeError:
            objs = [json.loads(o) for o in _split_json_objects(body)]
        objs = objs if isinstance(objs, list) else [objs]
        return [c for c in (_call_from_obj(o) for o in objs) if c is not None]


class ConstrainedToolCalls(ToolParser):
    """``tool_choice`` named or ``required``: the output was constrained to the
    function's arguments (named) or to ``[{"name", "parameters"}, ...]`` (required),
    so all of it is the calls (see :mod:`llmserve.entrypoints.openai.tools`)."""

    def __init__(self, function_name: str | None) -> None:
        self.function_name = function_name

    def find_start(self, text: str) -> int:
        return 0

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        calls = self.parse_calls(text, final=True)
        return (None, calls) if calls else (text or None, [])

    def parse_calls(self, region: str, final: bool) -> list[ParsedToolCall]:
        if not final:
            return []
        try:
            value = json.loads(region)
        except json.JSONDecodeError:
            return []  # cut by max_tokens: no call
        if self.function_name is not None:
            return [ParsedToolCall(self.function_name, json.dumps(value, ensure_ascii=False))]
        if not isinstance(value, list):
            return []
        return [c for c in (_call_from_obj(o, "parameters") for o in value) if c is not None]


def _marker_prefix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                best = max(best, k)
                break
    return best


class StreamingToolCalls:
    """Turns streamed text deltas into content deltas and complete tool calls.

    ``feed(delta)`` -> (content to send now, new calls); ``finish()`` -> the same for
    what was held back. ``max_calls`` (1 for ``parallel_tool_calls=false``) caps calls.
    """

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.sent_content = 0  # characters of text sent as content
        self.start = -1  # where tool calls begin, once seen
        self.calls: list[ParsedToolCall] = []

    def _new_calls(self, final: bool) -> list[ParsedToolCall]:
        if self.start < 0:
            return []
        calls = self.parser.parse_calls(self.text[self.start:], final)
        if self.max_calls is not None:
            calls = calls[:self.max_calls]
        new = calls[len(self.calls):]
        self.calls.extend(new)
        return new

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        self.text += delta
        if self.start < 0:
            self.start = self.parser.find_start(self.text)
        if self.start >= 0:
            content = self.text[self.sent_content:self.start]
        else:
            if isinstance(self.parser, Llama3JsonToolParser) and not self.text.strip():
                return "", []  # a leading blank could open a JSON call
            end = len(self.text) - _marker_prefix_len(self.text, self.parser.start_markers)
            content = self.text[self.sent_content:end]
        self.sent_content += len(content)
        return content, self._new_calls(final=False)

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        new = self._new_calls(final=True)
        if self.start >= 0 and not self.calls:  # the "calls" did not parse: content after all
            content = self.text[self.sent_content:]
        else:
            content = "" if self.start >= 0 else self.text[self.sent_content:]
        self.sent_content += len(content)
        return content, new

"""Bounded, sandboxed rendering of Jinja chat templates.

A chat template is code: it comes with the model file (a GGUF or a Hub directory) or,
when the operator allows it (``llmserve serve --trust-request-chat-template``, as in
vLLM), with the request. It runs in jinja2's ``ImmutableSandboxedEnvironment`` (no
attribute escapes, no mutation of the inputs, as ``transformers`` renders them), with
the names ``transformers`` gives templates (``raise_exception``, ``tojson``,
``strftime_now``, ``namespace``, ``dict``, ``loopcontrols``, ``{% generation %}``) and
the tokenizer's special tokens (``bos_token``, ``eos_token``, ...). jinja's sandbox has
no limit on time or size, so a render here also has :class:`RenderLimits`:

- size: ``*``, ``+``, ``%`` and ``**`` on strings, lists and integers, string methods
  (``replace``, ``join``, ``center``, ``format``, ...) and filters (``indent``,
  ``replace``, ``join``, ``center``, ``format``, ...) refuse to build a string or list
  longer than ``max_chars``, and the rendered text may not exceed it either
  (``{{ 'a b ' * 2000000 }}`` fails at once instead of building 8 MB);
- time: a per-thread trace function on the template's own frames stops a render that
  runs longer than ``timeout_s`` (loops that print nothing, deep recursion);
- every exception a template raises (``{{ 1/0 }}``, a recursive macro, a syntax error,
  a sandbox violation, ``raise_exception``) becomes :class:`ChatTemplateError`, a
  ``ValueError`` whose message says what the template did.

Run it off the event loop (``asyncio.to_thread``): it is CPU work of up to
``timeout_s``. Sources: transformers ``utils/chat_template_utils.py``
(``render_jinja_template``, ``_compile_jinja_template``), vLLM
``entrypoints/chat_utils.py`` (``--trust-request-chat-template``), jinja's sandbox
documentation ("Operator Intercepting").
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension

from llmserve.template_sandbox import (  # noqa: F401  (DEFAULT_MAX_RENDERED_CHARS re-exported)
    DEFAULT_MAX_RENDERED_CHARS,
    BoundedSandboxedEnvironment,
    _filter_guard,
    _LimitExceeded,
    _state,
)

DEFAULT_RENDER_TIMEOUT_S = 5.0
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclass(frozen=True)
class RenderLimits:
    """Limits of one render: wall-clock seconds and characters (of the output and of any
    string or list the template builds on the way)."""

    timeout_s: float = DEFAULT_RENDER_TIMEOUT_S
    max_chars: int = DEFAULT_MAX_RENDERED_CHARS

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {self.max_chars}")


class ChatTemplateError(ValueError):
    """The chat template failed, was refused by the sandbox, or hit a limit."""


class _RenderTimeout(BaseException):
    """Raised by the trace function; a BaseException so no ``except Exception`` in
    jinja's runtime swallows it."""


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag):
    renders its body; the mask itself is not needed for serving."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def raise_exception(message: Any) -> None:
    raise jinja2.TemplateError(str(message))


def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
           sort_keys: bool = False) -> str:
    """transformers' ``tojson``: ``json.dumps`` without HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(str(fmt))


class TemplateDict:
    """``dict(...)`` in a template, without the type's class attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


class TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names (no reaching into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for key in attrs:
            TemplateNamespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a namespace may not hold underscore names, got {name!r}")


@functools.lru_cache(maxsize=1)
def _environment() -> BoundedSandboxedEnvironment:
    env = BoundedSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _filter_guard(name, f) for name, f in env.filters.items()}
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


MAX_TEMPLATE_DEPTH = 128  # nested template frames (macros calling macros)


def _tracer(deadline: float):
    """A trace function: the deadline on every template line, and a bound on nested
    template frames. The bound is ours, far below Python's recursion limit: a traced
    call runs on the C stack, and 1,000 traced jinja frames can overflow it (a crash,
    not a RecursionError) when the caller's stack is already deep."""
    depth = 0

    def local(frame: Any, event: str, arg: Any):
        nonlocal depth
        if event == "return":
            depth -= 1
        elif event == "line" and time.monotonic() > deadline:
            raise _RenderTimeout
        return local

    def on_call(frame: Any, event: str, arg: Any):
        nonlocal depth
        if frame.f_code.co_filename == "<template>":  # jinja's compiled template code
            if time.monotonic() > deadline:
                raise _RenderTimeout
            depth += 1
            if depth > MAX_TEMPLATE_DEPTH:
                depth -= 1  # this frame gets no return event
                raise RecursionError("template frames nested too deeply")
            return local
        return None

    return on_call


def plain_value(value: Any, field: str, depth: int = 0) -> Any:
    """A copy of ``value`` made only of JSON types (str, int, float, bool, None, list,
    dict with string keys): what a template may see.

    Raises:
        ValueError: naming ``field`` (e.g. ``chat_template_kwargs.x[2]``) for any other
            type or nesting deeper than 64.
    """
    if depth > 64:
        raise ValueError(f"{field} is nested too deeply (more than 64 levels)")
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, (list, tuple)):
        return [plain_value(v, f"{field}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{field} keys must be strings, got {type(k).__name__}")
            out[k] = plain_value(v, f"{field}.{k}", depth + 1)
        return out
    raise ValueError(f"{field} must hold only JSON values (strings, numbers, booleans, null, "
                     f"lists, objects), got {type(value).__name__}")


def select_template(chat_template: str | dict | None, has_tools: bool) -> str:
    """The template source: a string, or from a dict of named templates (``tool_use``
    when tools are given, else ``default``), as transformers chooses.

    Raises:
        ValueError: no template, or a dict without a usable entry.
    """
    if isinstance(chat_template, dict):
        name = "tool_use" if has_tools and "tool_use" in chat_template else "default"
        if not isinstance(chat_template.get(name), str):
            raise ValueError(f"the tokenizer's chat templates {sorted(chat_template)} have no "
                             f"{name!r} entry")
        return chat_template[name]
    if not isinstance(chat_template, str) or not chat_template:
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt "
                         "to the completions API instead")
    return chat_template


def render_chat_template(source: str, messages: list[dict[str, Any]], *,
                         add_generation_prompt: bool = True,
                         continue_final_message: bool = False,
                         tools: list[dict[str, Any]] | None = None,
                         template_vars: dict[str, Any] | None = None,
                         limits: RenderLimits | None = None) -> str:
    """Render ``source`` over ``messages`` (already validated: ``content`` a string).

    ``template_vars`` (the tokenizer's special tokens, then ``chat_template_kwargs``)
    become template variables; keys whose value is None are dropped from each message
    (as transformers does). ``continue_final_message``: the text ends where the last
    message's content ends, so the model continues it (transformers' tag method).

    Returns:
        The rendered prompt text.

    Raises:
        ChatTemplateError: the template is not valid Jinja, raised an error, was
            refused by the sandbox, passed ``limits``, or dropped the final message.
        ValueError: ``continue_final_message`` with ``add_generation_prompt``.
    """
    limits = limits or RenderLimits()
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                         "true; set add_generation_prompt to false")
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    for m in chat:  # older names of a message's reasoning, read as reasoning_content
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning")
                          if m.get(k) is not None), None)
        if reasoning is not None:
            m.setdefault("thinking", reasoning)
            m["reasoning_content"] = reasoning
    final = ""
    if continue_final_message:
        final = chat[-1].get("content", "")
        chat[-1]["content"] = final + _CONTINUE_TAG
    context = {**(template_vars or {}), "messages": chat, "tools": tools, "documents": None,
               "add_generation_prompt": add_generation_prompt}
    text = _render(source, context, limits)
    if continue_final_message:
        loc = text.rfind(_CONTINUE_TAG.strip())
        if loc < 0 or final.strip() not in text:
            raise ChatTemplateError("continue_final_message: the chat template does not "
                                    "render the final message's content")
        text = text[:loc] if text[loc:loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG \
            else text[:loc].rstrip()
    return text


def _render(source: str, context: dict[str, Any], limits: RenderLimits) -> str:
    previous_limits, previous_trace = getattr(_state, "limits", None), sys.gettrace()
    _state.limits = limits
    pieces: list[str] = []
    try:
        sys.settrace(_tracer(time.monotonic() + limits.timeout_s))
        try:
            total = 0
            for piece in _compile(source).generate(**context):
                total += len(piece)
                if total > limits.max_chars:
                    raise _LimitExceeded(f"the rendered prompt is over the limit of "
                                         f"{limits.max_chars} characters")
                pieces.append(piece)
        finally:
            sys.settrace(previous_trace)
    except _RenderTimeout:
        raise ChatTemplateError(f"the chat template took longer than {limits.timeout_s:g} s "
                                f"to render") from None
    except _LimitExceeded as e:
        raise ChatTemplateError(f"the chat template exceeded its size limit: {e}") from None
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {e.message} "
                                f"(line {e.lineno})") from None
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"the chat template did something the sandbox forbids: "
                                f"{e}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None
    except RecursionError:
        raise ChatTemplateError("the chat template recursed too deeply") from None
    except Exception as e:  # anything else the template's code raised: {{ 1/0 }}
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    finally:
        _state.limits = previous_limits
    return "".join(pieces)

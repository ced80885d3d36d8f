"""The sandbox that chat templates render in (issue 20): jinja2's immutable sandbox
with a bound on every string, list and number a template builds, so a 135-byte
template cannot allocate gigabytes or stall the server. The per-render limit lives in
a thread-local set by :func:`llmserve.chat_template.render_chat_template`.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_MAX_RENDERED_CHARS = 1 << 18  # characters; the server raises it for long contexts
_MAX_EXPONENT_BITS = 1 << 16  # ``a ** b`` may make an integer of at most this many bits


class _LimitExceeded(Exception):
    """Raised inside the sandbox when a value would pass ``max_chars``."""


_state = threading.local()  # .limits: the RenderLimits of the render in this thread


def _max_chars() -> int:
    limits = getattr(_state, "limits", None)
    return limits.max_chars if limits is not None else DEFAULT_MAX_RENDERED_CHARS


def _refuse(what: str, size: int) -> None:
    cap = _max_chars()
    if size > cap:
        raise _LimitExceeded(f"{what} would be {size} long, over the limit of {cap}")


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple, dict)) else None


def _check_result(what: str, value: Any) -> Any:
    size = _size(value)
    if size is not None:
        _refuse(what, size)
    return value


def _check_ints(what: str, args: tuple, kwargs: dict) -> None:
    """Widths and counts of string methods and of some filters: none may pass
    ``max_chars`` (macros and other calls take any integer)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool):
            _refuse(f"an argument of {what}", abs(v))


# the width and precision of a %-conversion, and the spec of a {...:spec} field
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d*)(?:\.(\d+))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")


def _check_format(fmt: str) -> None:
    """``'%999999999d' % 1`` or ``'{:>999999999}'.format(1)``: refuse huge widths
    (digits elsewhere in the string, like a date, are text and fine)."""
    numbers = [n for m in _PERCENT_SPEC.finditer(fmt) for n in m.groups() if n]
    numbers += [n for m in _BRACE_SPEC.finditer(fmt) for n in re.findall(r"\d+", m.group(1))]
    for n in numbers:
        _refuse("a format width", int(n) if len(n) <= 12 else 10 ** 12)


def _join_size(sep: str, items: Any) -> int | None:
    if isinstance(items, str):  # joins the characters
        return len(items) + len(sep) * max(len(items) - 1, 0)
    if not isinstance(items, (list, tuple)):
        return None
    parts = [len(x) if isinstance(x, str) else len(str(x)) for x in items]
    return sum(parts) + len(sep) * max(len(parts) - 1, 0)


def _check_str_method(s: str, name: str, args: tuple, kwargs: dict) -> None:
    """Predict the size of string methods that can grow their input."""
    if name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        old, new = args[0], args[1]
        count = s.count(old) if old else len(s) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        _refuse("the result of replace", len(s) + count * (len(new) - len(old)))
    elif name == "join" and args:
        size = _join_size(s, args[0])
        if size is not None:
            _refuse("the result of join", size)
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            _refuse("the result of expandtabs", len(s) + s.count("\t") * max(tab, 0))


# filters whose integer arguments are sizes (widths, lengths, counts)
_WIDTH_FILTERS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice"})


def _filter_guard(name: str, func: Any) -> Any:
    """Wrap a filter: integer arguments and the result are bounded, and the filters
    that multiply their input are predicted before they run."""

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        values = args[1:] if getattr(func, "jinja_pass_arg", None) else args
        if name in _WIDTH_FILTERS:
            _check_ints(f"the filter {name}", values[1:], kwargs)
        if name == "join" and values:
            sep = values[1] if len(values) > 1 else kwargs.get("d", "")
            size = _join_size(sep if isinstance(sep, str) else "", values[0])
            if size is not None:
                _refuse("the result of join", size)
        elif values and isinstance(values[0], str):
            s = values[0]
            if name == "indent":
                width = values[1] if len(values) > 1 else kwargs.get("width", 4)
                width = len(width) if isinstance(width, str) else width
                if isinstance(width, int):
                    _refuse("the result of indent", len(s) + (s.count("\n") + 1) * width)
            elif name == "replace":
                _check_str_method(s, "replace", values[1:3], {})
            elif name == "format":
                _check_format(s)
        return _check_result(f"the result of the filter {name}", func(*args, **kwargs))

    return guarded


class BoundedSandboxedEnvironment(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox that also bounds the size of what a template builds
    (see the module docstring). Intercepting an operator also stops jinja from folding
    it at compile time, so ``{{ 'a' * 10**9 }}`` is refused instead of computed."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, k in ((left, right), (right, left)):
                if _size(seq) is not None and isinstance(k, int) and not isinstance(k, bool):
                    _refuse("a repeated string or list", _size(seq) * max(k, 0))
        elif operator == "+":
            a, b = _size(left), _size(right)
            if a is not None and b is not None:
                _refuse("a concatenation", a + b)
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
              and right > 0 and abs(left) > 1
              and left.bit_length() * right > _MAX_EXPONENT_BITS):
            raise _LimitExceeded(f"{left} ** {right} is too large")
        return _check_result("a result", super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:  # 'str'.format: the sandbox wraps it when it is read
            _check_format(value.__self__)
        return wrapped

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, (str, list, tuple, dict)):  # widths of 'x'.center(n), ...
            _check_ints(f"{name}()", args, kwargs)
        if isinstance(owner, str):
            _check_str_method(owner, name, args, kwargs)
        rv = super().call(__context, __obj, *args, **kwargs)
        return _check_result(f"the result of {name or 'a call'}()", rv)

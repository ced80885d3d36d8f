"""The bounded chat-template sandbox (llmserve.chat_template): same text as
transformers' renderer on real templates, and every hostile template stopped with a
ChatTemplateError (a ValueError) instead of running away, crashing or escaping."""

from __future__ import annotations

import pytest

from llmserve.chat_template import (
    ChatTemplateError,
    RenderLimits,
    plain_value,
    render_chat_template,
)
from llmserve.tokenizer import apply_chat_template, load_tokenizer

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi 你好"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "more"}]
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"

HOSTILE = [
    # (template, substring of the error)
    ("{{ 1/0 }}", "ZeroDivisionError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
    ("{{ 'a b ' * 2000000 }}", "size limit"),
    ("{{ ['x'] * 10**9 }}", "size limit"),
    ("{{ 'x'|center(10**9) }}", "size limit"),
    ("{{ 'x'.ljust(10**9) }}", "size limit"),
    ("{{ 2 ** (10 ** 8) }}", "too large"),
    ("{{ '%999999999d' % 1 }}", "size limit"),
    ("{{ '{:>999999999}'.format(1) }}", "size limit"),
    ("{% set s = 'a' * 100000 %}{{ s|replace('', s) }}", "result of replace"),
    ("{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}", "result of replace"),
    ("{{ ('ab\n' * 30000)|indent(100) }}", "result of indent"),
    ("{{ ('a' * 100000)|join('b' * 100) }}", "result of join"),
    ("{{ ('b' * 100).join('a' * 100000) }}", "result of join"),
    ("{% for i in range(100000) %}{{ 'fifteen chars..' }}{% endfor %}", "rendered prompt"),
    ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}", "size limit"),
    (LOOP, "took longer than"),
    ("{{ raise_exception('no system messages') }}", "rejected the messages: no system"),
    ("{{ messages.append(1) }}", "sandbox forbids"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox forbids"),
    ("{% set ns = namespace(_x=1) %}", "sandbox forbids"),
    ("{{ x", "not valid Jinja"),
]


@pytest.mark.parametrize("template,needle", HOSTILE)
def test_hostile_templates_fail_cleanly(template, needle):
    limits = RenderLimits(timeout_s=1.0)
    with pytest.raises(ChatTemplateError, match=needle.replace("(", r"\(")):
        render_chat_template(template, MSGS, limits=limits)
    # the render that failed left nothing behind: the next one is normal
    assert render_chat_template("{{ messages[0]['content'] }}", MSGS) == "be brief"


def test_limits_are_configurable():
    with pytest.raises(ChatTemplateError, match="over the limit of 10"):
        render_chat_template("{{ 'x' * 11 }}", MSGS, limits=RenderLimits(max_chars=10))
    assert render_chat_template("{{ 'x' * 10 }}", MSGS, limits=RenderLimits(max_chars=10)) \
        == "x" * 10
    with pytest.raises(ValueError, match="timeout_s"):
        RenderLimits(timeout_s=0)
    # numbers that are text, not widths, pass: a date in a format string, big loops
    assert render_chat_template("{{ '%s on 20250101' % 'x' }}|{{ '{} 1000000'.format(1) }}|"
                                "{{ range(100000)|length }}|{% macro f(t) %}{{ t }}{% endmacro %}"
                                "{{ f(1733000000) }}|{{ x|default(1733000000) }}", MSGS) == (
        "x on 20250101|1 1000000|100000|1733000000|1733000000")


def test_template_names_as_transformers():
    out = render_chat_template(
        "{{ messages|tojson }}|{{ bos_token }}|{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ dict(a=1)['a'] }}|"
        "{% generation %}gen{% endgeneration %}|{{ strftime_now('%Y')|length }}",
        MSGS[:1], template_vars={"bos_token": "<s>"})
    assert out == '[{"role": "system", "content": "be brief"}]|<s>|1|1|gen|4'


def test_plain_values_only():
    assert plain_value({"a": [1, 2.5, None, True, {"b": "c"}]}, "kw") == {
        "a": [1, 2.5, None, True, {"b": "c"}]}
    with pytest.raises(ValueError, match=r"kw\.a\[0\] must hold only JSON values"):
        plain_value({"a": [object()]}, "kw")
    with pytest.raises(ValueError, match="nested too deeply"):
        deep: list = []
        for _ in range(100):
            deep = [deep]
        plain_value(deep, "kw")


@pytest.fixture(scope="module")
def smol():
    from llmserve.loader import resolve_model

    return load_tokenizer(resolve_model(None))


@pytest.mark.model
@pytest.mark.parametrize("kw", [
    {"add_generation_prompt": True}, {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True, "upto": 3},
    {"add_generation_prompt": True, "upto": 1,
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
])
def test_same_text_as_transformers(smol, kw):
    """The oracle: transformers' own apply_chat_template on SmolLM2's template."""
    kw = dict(kw)
    msgs = MSGS[:kw.pop("upto", len(MSGS))]
    ref = smol.apply_chat_template(msgs, tokenize=False, **kw)
    ours = apply_chat_template(smol, msgs, **kw)
    assert ours == smol.encode(ref, add_special_tokens=False)


@pytest.mark.model
def test_continue_final_message_and_generation_prompt_conflict(smol):
    with pytest.raises(ValueError, match="cannot both be true"):
        apply_chat_template(smol, MSGS[:3], add_generation_prompt=True,
                            continue_final_message=True)

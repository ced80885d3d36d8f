"""The vocabulary a GGUF file stores: token strings, token types, the end-of-turn token.

llama.cpp's ``tokenizer.ggml.token_type`` (``gguf.TokenType``, llama.cpp
``llama_token_type``)::

    1 NORMAL   2 UNKNOWN   3 CONTROL (special: <|im_end|>, <repo_name>)
    4 USER_DEFINED (added, matched whole, not special: <tool_call>)   5 UNUSED   6 BYTE

The token that ends an assistant turn is found by rendering ``tokenizer.chat_template``
(:mod:`llmserve.chat_template`: sandboxed and bounded) for a one-turn conversation
and reading the control token right after the assistant's text: ``<|im_end|>`` for
ChatML, ``<|eot_id|>`` for Llama 3, ``<end_of_turn>`` for Gemma.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llmserve.loader.gguf_header import GGUFHeader

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
_SENTINEL = "LLMSERVE_ASSISTANT_TEXT_8f3a"


def special_token_table(header: GGUFHeader) -> dict[int, tuple[str, int]]:
    """``{token id: (token string, token type)}`` of every CONTROL and USER_DEFINED token.

    Empty when the file has no ``tokenizer.ggml.token_type``.
    """
    from llmserve.loader.gguf_header import read_gguf_array, read_gguf_strings

    types = read_gguf_array(header, "tokenizer.ggml.token_type")
    if types is None:
        return {}
    types = np.asarray(types)
    ids = np.flatnonzero((types == TOKEN_TYPE_CONTROL) | (types == TOKEN_TYPE_USER_DEFINED))
    if ids.size == 0:
        return {}
    tokens = read_gguf_strings(header, "tokenizer.ggml.tokens", [int(i) for i in ids])
    return {i: (text, int(types[i])) for i, text in tokens.items()}


def render_one_turn(template: str, bos_token: str = "", eos_token: str = "") -> str:
    """``template`` rendered for ``[user "Hi", assistant <sentinel>]`` (no generation
    prompt), in :mod:`llmserve.chat_template`'s bounded sandbox (1 s, 64 K characters).

    Raises:
        ChatTemplateError: the template fails on this conversation or passes the limits.
    """
    from llmserve.chat_template import RenderLimits, render_chat_template

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}]
    return render_chat_template(template, messages, add_generation_prompt=False,
                                template_vars={"bos_token": bos_token, "eos_token": eos_token},
                                limits=RenderLimits(timeout_s=1.0, max_chars=1 << 16))


def chat_template_end_of_turn(header: GGUFHeader) -> int | None:
    """Id of the CONTROL token that ends an assistant turn in ``tokenizer.chat_template``.

    Returns ``None`` when the file has no chat template, the template cannot be
    rendered, or no control token follows the assistant's text (then EOS alone ends
    generation, as in llama.cpp).
    """
    template = header.metadata.get("tokenizer.chat_template")
    if not isinstance(template, str) or not template:
        return None
    table = special_token_table(header)
    control = {text: i for i, (text, kind) in table.items() if kind == TOKEN_TYPE_CONTROL and text}
    if not control:
        return None
    meta = header.metadata

    def text_of(key: str) -> str:
        tid = meta.get(key)
        return table[tid][0] if isinstance(tid, int) and tid in table else ""

    try:
        rendered = render_one_turn(template, text_of("tokenizer.ggml.bos_token_id"),
                                   text_of("tokenizer.ggml.eos_token_id"))
    except ValueError:  # ChatTemplateError: no end-of-turn token, not a load error
        return None
    at = rendered.find(_SENTINEL)
    if at < 0:
        return None
    after = rendered[at + len(_SENTINEL):].lstrip()
    for text in sorted(control, key=len, reverse=True):  # longest match first
        if after.startswith(text):
            return control[text]
    return None

"""Byte-level tokens: a prompt that ends inside a multi-byte character, the raw bytes of
single tokens (OpenAI's logprobs ``bytes``), and the incomplete-UTF-8 helper.

Oracles: GPT-2's byte alphabet as ``transformers`` defines it (``bytes_to_unicode``),
Python's incremental UTF-8 decoder, and the tokenizer's own full decode.
"""

from __future__ import annotations

import codecs

import pytest

from llmserve.token_bytes import TokenBytes, incomplete_utf8_suffix_length, token_text
from llmserve.tokenizer import IncrementalDetokenizer
from tests.test_tokenizer import MULTIBYTE, encode, tok  # noqa: F401  (fixture)

ISSUE_PROMPT = [57, 2606, 15107, 232, 227, 10813, 234]  # "I love 🎉" + 3 of 🐨's 4 bytes


def oracle_bytes(tokenizer, ids: list[int]) -> bytes:
    """Token bytes through transformers' GPT-2 byte alphabet."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    inverse = {c: b for b, c in bytes_to_unicode().items()}
    return b"".join(bytes(inverse[ch] for ch in tokenizer.convert_ids_to_tokens(i)) for i in ids)


def pending_bytes(data: bytes) -> int:
    """How many trailing bytes Python's incremental UTF-8 decoder keeps buffered."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    dec.decode(data, final=False)
    return len(dec.getstate()[0])


def detokenize_after(tokenizer, prompt: list[int], output: list[int]) -> tuple[str, list[str]]:
    d = IncrementalDetokenizer(tokenizer, prompt)
    deltas = []
    for t in output:
        d.update([t])
        deltas.append(d.get_next_output_text(False, True))
    deltas.append(d.get_next_output_text(True, True))
    return d.output_text, deltas


def test_incomplete_suffix_matches_pythons_decoder():
    samples = [b"", b"a", b"\xc3", b"\xc3\xa9", b"\xe4\xbd", b"\xe4\xbd\xa0", b"\xf0",
               b"\xf0\x9f", b"\xf0\x9f\x90", b"\xf0\x9f\x90\xa8", b"x\xf0\x9f\x90\xa8\xe4",
               b"\x80", b"\x80\x80\x80", "你好🎉".encode()[:-1]]
    for s in samples:
        assert incomplete_utf8_suffix_length(s) == pending_bytes(s), s


@pytest.mark.parametrize("text", MULTIBYTE)
def test_prompt_ending_inside_a_character_keeps_it(tok, text):  # noqa: F811
    """Split the ids at every position: the output text is exactly the bytes after the
    prompt's last complete character, so a character the prompt starts is not lost."""
    ids = encode(tok, text)
    whole = oracle_bytes(tok, ids)
    assert whole.decode("utf-8") == text
    for k in range(1, len(ids)):
        prompt_bytes = oracle_bytes(tok, ids[:k])
        start = len(prompt_bytes) - pending_bytes(prompt_bytes)
        out, deltas = detokenize_after(tok, ids[:k], ids[k:])
        assert out == whole[start:].decode("utf-8"), (k, out)
        assert "".join(deltas) == out and all("\ufffd" not in d for d in deltas)


def test_token_bytes_of_partial_characters(tok):  # noqa: F811
    ids = encode(tok, "ü🇫🇷x 你好")
    tb = TokenBytes(tok)
    assert b"".join(tb(i) for i in ids) == oracle_bytes(tok, ids) == "ü🇫🇷x 你好".encode()
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert partial  # this vocabulary splits these characters into bytes
    for i in partial:
        raw = tb(i)
        assert token_text(raw) == "".join(f"\\x{b:02x}" if b >= 0x80 else chr(b) for b in raw)
    special = tok.convert_tokens_to_ids("<|im_end|>")
    assert tb(special) == b"<|im_end|>" and token_text(tb(special)) == "<|im_end|>"


@pytest.mark.model
def test_issue_prompt_on_smollm2():
    """The issue's reproduction on the real tokenizer: the token completing 🐨 emits it."""
    from llmserve.loader import resolve_model
    from llmserve.tokenizer import load_tokenizer

    smol = load_tokenizer(resolve_model(None))
    koala = smol.encode("I love 🎉🐨")
    assert koala[:-1] == ISSUE_PROMPT  # the prompt is 🐨 minus its last byte
    out, deltas = detokenize_after(smol, ISSUE_PROMPT, koala[-1:])
    assert out == "🐨" and deltas[0] == "🐨"
    longer = smol.encode("I love 🎉🐨 and 你好")
    assert longer[:len(ISSUE_PROMPT)] == ISSUE_PROMPT
    out, _ = detokenize_after(smol, ISSUE_PROMPT, longer[len(ISSUE_PROMPT):])
    assert out == "🐨 and 你好"
    tb = TokenBytes(smol)
    assert [tb(i) for i in ISSUE_PROMPT[-2:]] == [b"\xf0\x9f", b"\x90"]

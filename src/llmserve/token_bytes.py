"""The raw bytes of single tokens, for logprobs (OpenAI's ``bytes`` field and its
``"bytes:\\xNN"`` token form), and UTF-8 helpers for characters split over tokens.

Pure Python; the tokenizer is passed in (a Hugging Face tokenizer).
"""

from __future__ import annotations

import re
from typing import Any


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte -> printable character map, inverted (``bytes_to_unicode`` in
    openai/gpt-2 ``encoder.py``; the ``ByteLevel`` pre-tokenizer of ``tokenizers``)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
          *range(ord("\xae"), ord("\xff") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_FALLBACK_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """The raw UTF-8 bytes of single tokens, for logprobs (OpenAI's ``bytes`` field).

    A byte-level BPE token (GPT-2, Llama 3, Qwen, SmolLM) or a SentencePiece byte
    fallback token (``<0xF0>``) can hold part of a character; decoded alone it is
    U+FFFD. Its bytes come from the token string: GPT-2's byte alphabet inverted, or
    the ``<0xNN>`` value. A token that decodes alone without U+FFFD is its text's
    UTF-8. Results are cached per id; thread-safe for readers (a dict).

    Args:
        tokenizer: a Hugging Face tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._alphabet: dict[str, int] | None = None
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        """The bytes of ``token_id`` (special tokens: their text)."""
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._compute(token_id)
        return b

    def _compute(self, token_id: int) -> bytes:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
        m = _BYTE_FALLBACK_RE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self._alphabet is None:
            self._alphabet = _byte_level_alphabet()
        if piece and all(ch in self._alphabet for ch in piece):
            return bytes(self._alphabet[ch] for ch in piece)
        return text.encode("utf-8")  # a genuine U+FFFD, or an unknown scheme


def token_text(raw: bytes) -> str:
    """A token's text for logprobs: its characters, with bytes that are not whole UTF-8
    written as ``\\xNN`` (OpenAI's form, e.g. ``"\\xf0\\x9f"`` for half an emoji)."""
    return raw.decode("utf-8", errors="backslashreplace")


def incomplete_utf8_suffix_length(data: bytes) -> int:
    """How many bytes at the end of ``data`` start a UTF-8 character that is not
    complete yet (0-3): a lead byte followed by fewer continuation bytes than it needs."""
    for k in range(1, min(3, len(data)) + 1):
        b = data[-k]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 \
            else 1
        return k if need > k else 0
    return 0

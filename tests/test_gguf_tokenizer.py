"""GGUF tokenizers: control tokens are special, user-defined tokens are added but not
special, and generation ends at EOS/EOT from the metadata and at the chat template's
end-of-turn token. A tiny byte-level GGUF vocabulary, converted by transformers."""

from __future__ import annotations

import numpy as np
import pytest

from llmserve.loader import ModelSource
from llmserve.loader.gguf_loader import read_gguf_config
from llmserve.tokenizer import load_tokenizer

from .test_loader import write_gguf

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}")
# CONTROL (3) and USER_DEFINED (4) tokens after the 256 byte-level characters and 2 merges.
ADDED = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<repo_name>", 3),
         ("<file_sep>", 3), ("<tool_call>", 4), ("<|start_header_id|>", 3),
         ("<|end_header_id|>", 3), ("<|eot_id|>", 3)]


def byte_level_gguf(path, template=CHATML, eos="<|endoftext|>"):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + ["he", "ll"] + [t for t, _ in ADDED]
    types = [1] * (len(alphabet) + 2) + [k for _, k in ADDED]
    ids = {t: i for i, t in enumerate(tokens)}
    extra = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
             "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
             "tokenizer.ggml.merges": ["h e", "l l"], "tokenizer.chat_template": template}
    w = write_gguf(path, {"token_embd.weight": (np.zeros((len(tokens), 64), np.float32), None)},
                   arch="qwen2", vocab_size=len(tokens), extra=extra, eos_token_id=ids[eos])
    return w, ids, ids[eos]


@pytest.mark.parametrize("cached", [False, True], ids=["converted", "cached"])
@pytest.mark.parametrize("transformers_marks", [True, False], ids=["transformers", "no-marks"])
def test_control_tokens_are_special(tmp_path, monkeypatch, transformers_marks, cached):
    """With transformers' own marking, and without it (as transformers < 5 converted);
    fresh from the conversion, and reloaded from the tokenizer cache."""
    if not transformers_marks:
        import transformers.integrations.gguf.gguf_tokenizer_mapping as mapping

        monkeypatch.setattr(mapping, "add_gguf_special_tokens", lambda tokenizer, d: tokenizer)
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache") if cached else "")
    path, ids, _ = byte_level_gguf(tmp_path / "v.gguf")
    tok = load_tokenizer(ModelSource("gguf", path, "v"))
    if cached:
        assert list((tmp_path / "cache").glob("tokenizers/*/tokenizer.json"))
        tok = load_tokenizer(ModelSource("gguf", path, "v"))
    text = "<repo_name>hello<file_sep>x<tool_call>y<|im_end|>"
    encoded = tok.encode(text, add_special_tokens=False)
    assert encoded[0] == ids["<repo_name>"] and ids["<tool_call>"] in encoded
    assert ids["<file_sep>"] in encoded and encoded[-1] == ids["<|im_end|>"]
    assert tok.decode(encoded, skip_special_tokens=True) == "hellox<tool_call>y"
    assert tok.decode(encoded, skip_special_tokens=False) == text
    added = tok.added_tokens_decoder
    assert all(added[ids[t]].special == (k == 3) and added[ids[t]].content == t for t, k in ADDED)


@pytest.mark.parametrize("template, eos, end_of_turn", [
    (CHATML, "<|endoftext|>", "<|im_end|>"),   # a base-style eos, ChatML turns
    (LLAMA3, "<|endoftext|>", "<|eot_id|>"),   # Llama 3 turns end in <|eot_id|>
    (CHATML, "<|im_end|>", None),              # eos already ends the turn
    ("{{ raise_exception('no') }}", "<|endoftext|>", None),  # a template that fails: eos only
    ("{% for i in range(60000) %}{% for j in range(60000) %}{% endfor %}{% endfor %}",
     "<|endoftext|>", None),  # one that would run for hours: stopped by the render limit
])
def test_eos_ids_include_chat_template_end_of_turn(tmp_path, template, eos, end_of_turn):
    path, ids, eos_id = byte_level_gguf(tmp_path / "e.gguf", template, eos)
    config, _ = read_gguf_config(path)
    expected = [eos_id] + ([ids[end_of_turn]] if end_of_turn else [])
    assert config.eos_token_ids == tuple(expected)

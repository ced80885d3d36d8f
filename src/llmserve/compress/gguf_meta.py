"""GGUF metadata for ``llmserve export --format gguf``: hyper-parameters and tokenizer.

Written with the keys and conventions of llama.cpp's ``convert_hf_to_gguf.py``
(``TextModel.set_gguf_parameters``, ``get_vocab_base``, ``_set_vocab_gpt2``):

=====================================  ==========================================
GGUF key (``{arch}`` = llama/qwen2/..)  source
=====================================  ==========================================
``{arch}.context_length``               ``max_position_embeddings``
``{arch}.embedding_length``             ``hidden_size``
``{arch}.block_count``                  ``num_hidden_layers``
``{arch}.feed_forward_length``          ``intermediate_size``
``{arch}.attention.head_count[_kv]``    ``num_attention_heads`` / ``num_key_value_heads``
``{arch}.attention.key/value_length``   ``head_dim`` (when != hidden / heads, or qwen3)
``{arch}.rope.dimension_count``         ``head_dim`` (llama)
``{arch}.rope.freq_base``               ``rope_theta``
``{arch}.attention.layer_norm_rms_eps``  ``rms_norm_eps``
``{arch}.vocab_size``                   ``vocab_size``
``tokenizer.ggml.model`` = ``gpt2``     byte-level BPE (``tokenizer.json``)
``tokenizer.ggml.pre``                  sha256 of the tokens of llama.cpp's check text
``tokenizer.ggml.tokens/token_type``    vocab by id; added tokens CONTROL/USER_DEFINED
``tokenizer.ggml.merges``, special ids  ``gguf.SpecialVocab`` (merges, bos/eos/unk/pad,
``tokenizer.chat_template``             add_bos_token, chat template)
=====================================  ==========================================
"""

from __future__ import annotations

import logging
import os
from hashlib import sha256
from typing import Any

import gguf

from llmserve.config import ModelConfig

logger = logging.getLogger(__name__)

# Hugging Face architecture -> GGUF general.architecture (llama.cpp stores Mistral as llama)
GGUF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                      "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}

# convert_hf_to_gguf.py get_vocab_base_pre(): tokens of this text, hashed, name the
# BPE pre-tokenizer llama.cpp must run (a few of its table's entries).
CHECK_TEXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis '
              'concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 '
              'កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български '
              '\'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you '
              'sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",
}


def gguf_architecture(config: ModelConfig) -> str:
    """The GGUF ``general.architecture`` of ``config``.

    Raises:
        ValueError: an architecture llama.cpp's dense decoders do not cover here.
    """
    arch = GGUF_ARCHITECTURES.get(config.architecture)
    if arch is None:
        raise ValueError(f"--format gguf supports {sorted(GGUF_ARCHITECTURES)}, not "
                         f"{config.architecture!r}")
    return arch


def add_hparams(writer: gguf.GGUFWriter, config: ModelConfig, arch: str) -> None:
    """Write the ``{arch}.*`` hyper-parameters of ``config`` (see the module table).

    Raises:
        ValueError: a RoPE scaling other than linear (llama.cpp needs extra tensors).
    """
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3" or head_dim * config.num_attention_heads != config.hidden_size:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    scaling = config.rope_scaling
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        return
    raise ValueError(f"--format gguf: rope_scaling {kind!r} is not supported (linear or none)")


def _looks_special(token: str) -> bool:
    # convert_hf_to_gguf.py TextModel.does_token_look_special
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def pre_tokenizer(tokenizer: Any) -> str:
    """``tokenizer.ggml.pre`` for a Hugging Face tokenizer (llama.cpp's hash table);
    ``"default"`` with a warning when the hash is not one we know."""
    chkhsh = sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    name = PRE_TOKENIZERS.get(chkhsh)
    if name is None:
        logger.warning("BPE pre-tokenizer not recognized (chkhsh %s); writing 'default' "
                       "(llama.cpp may split text differently than the model was trained)",
                       chkhsh)
        return "default"
    return name


def vocab_tokens(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """``(tokens, token_types)`` by id, as ``get_vocab_base`` builds them: missing ids
    ``[PAD{i}]`` (UNUSED), added special tokens CONTROL, other added tokens
    USER_DEFINED, the rest NORMAL."""
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        tokens.append(token)
        if token in added:
            special = decoder[i].special if i in decoder else False
            types.append(gguf.TokenType.CONTROL if special or _looks_special(token)
                         else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def add_hf_tokenizer(writer: gguf.GGUFWriter, model_dir: str, config: ModelConfig) -> None:
    """Write the ``tokenizer.*`` keys of the Hugging Face tokenizer in ``model_dir``.

    Raises:
        ValueError: no fast (``tokenizer.json``) byte-level BPE tokenizer in ``model_dir``.
    """
    from transformers import AutoTokenizer

    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        raise ValueError(f"{model_dir!r} has no tokenizer.json; --format gguf needs the "
                         "model's fast (byte-level BPE) tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokens, types = vocab_tokens(tokenizer, config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens))
    if not special.merges:
        raise ValueError(f"{model_dir!r}: tokenizer.json has no BPE merges; only byte-level "
                         "BPE tokenizers are exported to GGUF here")
    special.add_to_gguf(writer, quiet=True)


SKIPPED_KEYS = ("GGUF.", "general.architecture", "general.file_type",
                "general.quantization_version")


def copy_metadata(writer: gguf.GGUFWriter, reader: gguf.GGUFReader) -> None:
    """Copy every key of a source GGUF (hyper-parameters, tokenizer, chat template,
    general.*) except the reader's own and the file type (written anew)."""
    for key, field in reader.fields.items():
        if key.startswith(SKIPPED_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)

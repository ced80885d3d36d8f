"""A reduced draft vocabulary: the draft scores only token ids ``[0, N)``.

FR-Spec (Zhao et al., "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling", ACL 2025; SGLang's ``--speculative-token-map``)
observes that a small draft spends much of each step in its LM head when the
vocabulary is large: Qwen2.5-Coder-0.5B's head is 151936 x 896, 36 % of the bytes its
decode step reads. Restricting the draft to the most frequent tokens cuts that part
by ``1 - N / vocab`` and changes nothing about the output: the draft only *proposes*,
and the target's verification is lossless for any proposal distribution ``q`` (a
token outside the subset has ``q = 0``, so it is never drafted, and the rejection
rule's residual ``max(0, p - q)`` still covers it).

The subset is the first ``N`` ids. In a byte-level BPE vocabulary (GPT-2, Llama 3,
Qwen) ids follow the merge order, which follows pair frequency in the tokenizer's
training corpus, so a prefix is a frequency ranking without a corpus of our own.
On the project's evaluation text, ids below 32768 cover 98 % of Qwen2.5's code
tokens and 92 % of its English ones, but only 22 % of its Chinese ones: leave the
option off for Chinese-heavy traffic. The head keeps the checkpoint's format (a
GGUF tensor is cut by whole rows and stays quantized)::

    draft lm_head [vocab, hidden]  ->  rows 0 .. N-1  ->  logits [B, N]
    padded with -inf to [B, vocab]  ->  argmax / q as before
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from llmserve.layers.linear import Linear
from llmserve.layers.parallel_linear import narrow_weight

EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


class DraftLMHead(Linear):
    """An LM head that loads (and scores) rows ``0 .. num_ids - 1`` of the checkpoint's
    ``[vocab, hidden]`` weight; ``forward``: ``[B, hidden] -> [B, num_ids]``."""

    def __init__(self, hidden_size: int, num_ids: int, dtype: torch.dtype) -> None:
        super().__init__(hidden_size, num_ids, bias=False, dtype=dtype)

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        super().weight_loader(param, narrow_weight(loaded_weight, 0, 0, self.output_size),
                              shard_id)


def restrict_draft_vocab(model: nn.Module, num_ids: int,
                         weights: Iterable[tuple[str, torch.Tensor]],
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Give ``model`` (before its weights load) a :class:`DraftLMHead` of ``num_ids``
    rows, now; returns the weights to load into it (a tied model's embedding also
    feeds the head, which is then its own tensor)."""
    model.lm_head = DraftLMHead(model.config.hidden_size, num_ids, model.dtype)
    tied = model.tie_word_embeddings
    model.tie_word_embeddings = False
    return _feed_head(weights, tied)


def _feed_head(weights: Iterable[tuple[str, torch.Tensor]], tied: bool,
               ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name == LM_HEAD and tied:
            continue
        yield name, tensor
        if name == EMBEDDING and tied:
            yield LM_HEAD, tensor


def pad_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, N]`` logits of ids ``0 .. N-1`` -> ``[B, vocab_size]``, ``-inf`` after."""
    if logits.shape[-1] == vocab_size:
        return logits
    out = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    out[:, :logits.shape[-1]] = logits
    return out

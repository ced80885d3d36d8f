"""The ``"reference"`` attention backend: obviously correct, slow.

A Python loop over sequences; each one gathers its whole context from the
paged cache through its block table and runs float32 softmax attention with
an explicit causal (and sliding-window) mask. It is the oracle the fast
backends are tested against (PagedAttention, Kwon et al. 2023; masks as in
Hugging Face transformers).
"""

from __future__ import annotations

import torch

from llmserve.layers.attention.backend import AttentionBackend, CommonAttentionMetadata
from llmserve.layers.attention.kv_quant import dequantize_kv
from llmserve.layers.attention.kv_quant_pc import dequantize_key_blocks, is_per_channel_key_cache


def causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                sliding_window: int | None) -> torch.Tensor:
    """Boolean ``[num_queries, num_keys]`` mask, True where the query may attend.

    ``key <= query`` and, with a window ``W``, ``key > query - W``.
    """
    q = query_positions[:, None]
    k = key_positions[None, :]
    mask = k <= q
    if sliding_window is not None:
        mask &= k > q - sliding_window
    return mask


class ReferenceAttentionBackend(AttentionBackend):
    """Per-sequence loop, fp32 math, GQA by repeating KV heads."""

    name = "reference"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: CommonAttentionMetadata) -> torch.Tensor:
        if self.sliding_window is not None:  # a local layer: maybe the window pool
            metadata = metadata.for_layer_window(self.sliding_window)
        self.write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        if metadata.block_scores is not None:  # KV eviction wants block scores
            from llmserve.layers.attention.scored import scored_attention

            return scored_attention(self, query, key_cache, value_cache, metadata)
        block_size = value_cache.shape[1]
        output = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        start = 0
        for i, (query_len, seq_len) in enumerate(
                zip(metadata.query_lens, metadata.seq_lens_list, strict=True)):
            end = start + query_len
            num_blocks = (seq_len + block_size - 1) // block_size
            block_ids = metadata.block_table[i, :num_blocks]
            # [seq_len, num_kv_heads, head_dim]
            # (a quantized cache, kv_quant.py: dequantized rows)
            if is_per_channel_key_cache(key_cache, self.head_dim):  # kv_quant_pc.py
                seq_key = dequantize_key_blocks(key_cache[block_ids]).flatten(0, 1)[:seq_len]
            else:
                seq_key = dequantize_kv(key_cache[block_ids].flatten(0, 1)[:seq_len])
            seq_value = dequantize_kv(value_cache[block_ids].flatten(0, 1)[:seq_len])
            # [seq_len, num_heads, head_dim]
            seq_key = seq_key.repeat_interleave(self.num_queries_per_kv, dim=1)
            seq_value = seq_value.repeat_interleave(self.num_queries_per_kv, dim=1)
            seq_query = query[start:end].float()  # [query_len, num_heads, head_dim]

            scores = torch.einsum("qhd,khd->hqk", seq_query, seq_key) * self.scale
            device = query.device
            query_positions = torch.arange(seq_len - query_len, seq_len, device=device)
            key_positions = torch.arange(seq_len, device=device)
            mask = causal_mask(query_positions, key_positions,
                               self.layer_window(metadata.sliding_window))
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)  # [num_heads, query_len, seq_len]
            output[start:end] = torch.einsum("hqk,khd->qhd", probs, seq_value).to(query.dtype)
            start = end
        return output

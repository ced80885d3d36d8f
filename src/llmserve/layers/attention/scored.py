"""Attention that also sums, per KV block, the attention each scored query puts on it.

KV eviction by attention (H2O, SnapKV; ``kv_cache/eviction``) needs to know how much
attention every kept block receives. A step that asks for it
(``CommonAttentionMetadata.block_scores``) runs its attention through this path: per
sequence, the scores ``scale * q . k`` over the paged context, the causal (and window)
mask, a float32 softmax, the output ``probs @ V`` -- and, for a scored sequence, the
softmax probabilities of its scored query rows summed over the query heads and rows,
then over each block's key slots, are added to its accumulator::

    probs  [num_heads, query_len, context]   rows >= first_row of a scored sequence
      -> sum over heads and rows   [context]
      -> pad to num_blocks * block_size, view [num_blocks, block_size], sum -> [num_blocks]

Every layer adds into the same accumulator, so a block's score is summed over layers
too (one block table serves all layers). The scores come out of the attention that
computes the step's output, not from a second pass. Grouped-query attention by
repeating KV heads; math as the reference backend (float32, output in the query's
dtype). A new path beside the C decode kernel (which it leaves unchanged).
Source: Zhang et al., H2O (NeurIPS 2023) and Li et al., SnapKV (2024) for the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.layers.attention.reference import causal_mask

# query rows per score matrix: [num_heads, ROW_TILE, context] float32 at a time
ROW_TILE = 256


@dataclass
class BlockScoreRequest:
    """One scored sequence of a step: its query rows ``first_row ..`` (relative to its
    first query token this step) add into ``scores`` ``[num_blocks]`` float32, one entry
    per block of its block table."""

    first_row: int
    scores: torch.Tensor


def scored_attention(backend, query: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, common) -> torch.Tensor:
    """Attention over the paged cache for every sequence of the step (K/V already
    written), accumulating block scores for the sequences in ``common.block_scores``
    (``{sequence index: BlockScoreRequest}``).

    Args:
        backend: the layer's :class:`AttentionBackend` (heads, scale, window).
        query: ``[num_tokens, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        common: the step's :class:`CommonAttentionMetadata`.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.
    """
    block_size = key_cache.shape[1]
    window = backend.layer_window(common.sliding_window)
    requests = common.block_scores
    output = torch.empty_like(query)
    device = query.device
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(common.query_lens, common.seq_lens_list,
                                                 strict=True)):
        end = start + query_len
        num_blocks = (seq_len + block_size - 1) // block_size
        block_ids = common.block_table[i, :num_blocks]
        # [seq_len, num_kv_heads, head_dim] -> [seq_len, num_heads, head_dim]
        seq_key = key_cache[block_ids].flatten(0, 1)[:seq_len].float()
        seq_value = value_cache[block_ids].flatten(0, 1)[:seq_len].float()
        seq_key = seq_key.repeat_interleave(backend.num_queries_per_kv, dim=1)
        seq_value = seq_value.repeat_interleave(backend.num_queries_per_kv, dim=1)
        req = requests.get(i)
        per_key = torch.zeros(num_blocks * block_size, dtype=torch.float32, device=device)
        for r0 in range(0, query_len, ROW_TILE):  # bounded memory for long prompts
            r1 = min(r0 + ROW_TILE, query_len)
            q = query[start + r0:start + r1].float()  # [rows, num_heads, head_dim]
            scores = torch.einsum("qhd,khd->hqk", q, seq_key) * backend.scale
            first = seq_len - query_len
            mask = causal_mask(torch.arange(first + r0, first + r1, device=device),
                               torch.arange(seq_len, device=device), window)
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            output[start + r0:start + r1] = torch.einsum(
                "hqk,khd->qhd", probs, seq_value).to(query.dtype)
            if req is not None and req.first_row < r1:
                per_key[:seq_len] += probs[:, max(0, req.first_row - r0):].sum(dim=(0, 1))
        if req is not None and req.first_row < query_len:
            req.scores[:num_blocks] += per_key.view(num_blocks, block_size).sum(1)
        start = end
    return output

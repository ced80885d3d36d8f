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
dtype; a quantized cache dequantized first). On the ``"cpu"`` backend only prompt rows
come here: decode rows take the C decode kernels, which accumulate the same sums from
their split-K softmax (``kernels/cpu_kernels_attn_scores.c``); this module is their
test oracle.
Source: Zhang et al., H2O (NeurIPS 2023) and Li et al., SnapKV (2024) for the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.layers.attention.kv_quant import dequantize_kv
from llmserve.layers.attention.reference import causal_mask

# query rows per score matrix: [num_heads, ROW_TILE, context] float32 at a time
ROW_TILE = 256
# decode rows of a scored step take the C decode kernels, which accumulate the scores in
# their own softmax (kernels/cpu_kernels_attn_scores.c); False sends every row of a scored
# step here (the path before; for tests and benchmarks)
KERNEL_DECODE_SCORES = True


# scored prompt rows (H2O's prompt, SnapKV's window) take the C decode kernels too, each
# token as a one-token decode of its own context (kernel_prompt_scores); False sends them
# to scored_attention
KERNEL_PROMPT_SCORES = True


@dataclass
class BlockScoreRequest:
    """One scored sequence of a step: its query rows ``first_row ..`` (relative to its
    first query token this step) add into ``scores`` ``[num_blocks]`` float32, one entry
    per block of its block table."""

    first_row: int
    scores: torch.Tensor


def scored_attention(backend, query: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, common, first_seq: int = 0,
                     end_seq: int | None = None) -> torch.Tensor:
    """Attention over the paged cache for the sequences ``first_seq .. end_seq - 1`` (default:
    to the last) of the step (K/V
    already written), accumulating block scores for the sequences in
    ``common.block_scores`` (``{sequence index: BlockScoreRequest}``).

    Args:
        backend: the layer's :class:`AttentionBackend` (heads, scale, window).
        query: ``[num_tokens, num_heads, head_dim]``, the query rows of those sequences
            only.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``
            (or a quantized cache, ``[..., head_dim + 2]``: ``kv_quant.py``).
        common: the step's :class:`CommonAttentionMetadata`.
        first_seq, end_seq: the sequences computed (e.g. ``num_decodes ..``: the prompts).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.
    """
    block_size = key_cache.shape[1]
    window = backend.layer_window(common.sliding_window)
    requests = common.block_scores
    output = torch.empty_like(query)
    device = query.device
    num_kv, group = backend.num_kv_heads, backend.num_queries_per_kv
    start = 0
    for i in range(first_seq, common.num_seqs if end_seq is None else end_seq):
        query_len, seq_len = common.query_lens[i], common.seq_lens_list[i]
        num_blocks = (seq_len + block_size - 1) // block_size
        block_ids = common.block_table[i, :num_blocks]
        # [num_kv_heads, seq_len, head_dim] float32; query heads h = kv * group + g
        seq_key = dequantize_kv(key_cache[block_ids].flatten(0, 1)[:seq_len]).float()
        seq_value = dequantize_kv(value_cache[block_ids].flatten(0, 1)[:seq_len]).float()
        seq_key, seq_value = seq_key.transpose(0, 1), seq_value.transpose(0, 1)
        req = requests.get(i)
        per_key = torch.zeros(num_blocks * block_size, dtype=torch.float32, device=device)
        first = seq_len - query_len  # position of the first query row
        for r0 in range(0, query_len, ROW_TILE):  # bounded memory for long prompts
            r1 = min(r0 + ROW_TILE, query_len)
            rows = r1 - r0
            # keys lo .. hi - 1: past the tile's last row every key is masked for every
            # row; before the first row's window start, every key is out of every window
            hi = first + r1
            lo = 0 if window is None else max(0, first + r0 - window + 1)
            q = (query[start + r0:start + r1].float() * backend.scale).view(
                rows, num_kv, group, -1).permute(1, 2, 0, 3).reshape(num_kv, group * rows, -1)
            scores = torch.bmm(q, seq_key[:, lo:hi].transpose(1, 2)).view(
                num_kv, group, rows, hi - lo)
            mask = causal_mask(torch.arange(first + r0, first + r1, device=device),
                               torch.arange(lo, hi, device=device), window)
            probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1)
            out = torch.bmm(probs.view(num_kv, group * rows, hi - lo), seq_value[:, lo:hi])
            output[start + r0:start + r1] = out.view(num_kv, group, rows, -1).permute(
                2, 0, 1, 3).reshape(rows, num_kv * group, -1).to(query.dtype)
            if req is not None and req.first_row < r1:
                per_key[lo:hi] += probs[:, :, max(0, req.first_row - r0):].sum(dim=(0, 1, 2))
        if req is not None and req.first_row < query_len:
            req.scores[:num_blocks] += per_key.view(num_blocks, block_size).sum(1)
        start += query_len
    return output


def cpu_scored_forward(backend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       key_cache: torch.Tensor, value_cache: torch.Tensor,
                       metadata) -> torch.Tensor:
    """The ``"cpu"`` backend's forward in a step whose KV eviction wants block scores.

    Decode rows (the step's first sequences, one token each; scored when their
    ``first_row <= 0``) run the C decode kernels with per-sequence accumulators, which
    sum the scores from the kernels' own split-K softmax (``cpu_kernels_attn_scores.c``),
    so a decode's output has the same bits scored or not. Prompt rows run
    :func:`scored_attention` when a prompt of the step is scored (SnapKV's observation
    window, H2O's prompt), else the backend's usual tiles. Without the C kernels (or
    with ``KERNEL_DECODE_SCORES`` off) every row runs :func:`scored_attention`.

    Args:
        backend: the layer's ``CpuAttentionBackend``.
        query: ``[num_tokens, num_heads, head_dim]``; key, value:
            ``[num_tokens, num_kv_heads, head_dim]`` (written to the caches here).
        key_cache, value_cache: the layer's paged caches.
        metadata: the step's ``CpuAttentionMetadata`` (or a half of ``split_decodes``).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.
    """
    common = metadata.step_common()
    if backend.sliding_window is not None:  # this layer's own window
        metadata = metadata.for_window(backend.sliding_window)
    backend.write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
    nd, step_nd = metadata.num_decodes, common.num_decodes
    decoded = None
    if nd:
        try:
            arrays = metadata.decode_score_arrays() if KERNEL_DECODE_SCORES else False
        except ValueError:  # accumulators the kernels cannot take (not float32 on the CPU)
            arrays = False
        if arrays is not False:
            decoded = backend._decode_kernel(query[:nd], key_cache, value_cache, metadata,
                                             arrays)
        if decoded is None:  # every row of this metadata (its decodes come first) here
            return scored_attention(backend, query, key_cache, value_cache, common, 0,
                                    None if metadata.num_prefills else nd)
        if not metadata.num_prefills:
            return decoded
    if any(i >= step_nd and req.first_row < common.query_lens[i]
           for i, req in metadata.block_scores.items()):
        prompts = None
        if KERNEL_PROMPT_SCORES:
            prompts = kernel_prompt_scores(backend, query[nd:], key_cache, value_cache,
                                           metadata, common)
        if prompts is None:
            prompts = scored_attention(backend, query[nd:], key_cache, value_cache, common,
                                       step_nd)
    else:
        prompts = backend._prefill(query[nd:], key[nd:], value[nd:], key_cache, value_cache,
                                   metadata)
    if decoded is None:
        return prompts
    output = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
    output[:nd], output[nd:] = decoded, prompts
    return output


@dataclass
class PromptScoreTables:
    """A scored step's prompt rows as one-token decodes, built once per step (and window):
    per prompt token its sequence's block table row and ``seq_len = position + 1``, and
    one accumulator row per scored token (the kernels need one array per row: rows run
    on different threads)::

        scratch [num_scored_rows, width] float32 --sum rows of a request--> its scores

    ``spans``: ``(request, first scratch row, end scratch row)`` per scored prompt."""

    block_table: torch.Tensor  # [num_prompt_tokens, width] int64
    seq_lens: torch.Tensor  # [num_prompt_tokens] int64
    scratch: torch.Tensor  # [num_scored_rows, width] float32
    arrays: object  # kernels.cpu.BlockScoreArrays over the prompt tokens
    spans: list


def _prompt_score_tables(metadata, common) -> PromptScoreTables:
    from llmserve.kernels.cpu import CpuKernels
    from llmserve.layers.attention.cpu import _quant_prefill_tables

    block_table, seq_lens = _quant_prefill_tables(metadata.prefills)
    width = block_table.shape[1]
    scored_rows, spans, lo = [], [], 0  # per prompt token: scored?; per scored prompt
    for i in range(common.num_decodes, common.num_seqs):
        n = common.query_lens[i]
        req = metadata.block_scores.get(i)
        first = n if req is None else min(max(req.first_row, 0), n)
        if first < n:
            spans.append((req, lo, lo + n - first))
            lo += n - first
        scored_rows.extend([False] * first + [True] * (n - first))
    scratch = torch.zeros(lo, width, dtype=torch.float32)
    arrays, k = [], 0
    for scored in scored_rows:
        arrays.append(scratch[k] if scored else None)
        k += scored
    return PromptScoreTables(block_table, seq_lens, scratch,
                             CpuKernels.block_score_arrays(arrays), spans)


def kernel_prompt_scores(backend, query: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, metadata, common) -> torch.Tensor | None:
    """A scored step's prompt rows through the C decode kernels: each token as a
    one-token decode of its own context (as the quantized prompt path), its block scores
    accumulated by the kernel's own softmax into its scratch row, the rows of each scored
    prompt then summed into its ``BlockScoreRequest``. The same sums as
    :func:`scored_attention` (its test oracle), in float32, without a probability matrix.

    Args:
        query: ``[num_prompt_tokens, num_heads, head_dim]``, the step's prompt rows (K/V
            written); metadata: the layer's ``CpuAttentionMetadata`` (window applied).

    Returns:
        ``[num_prompt_tokens, num_heads, head_dim]`` in ``query``'s dtype, or None where
        the kernels do not apply (no library, not CPU, another dtype or layout).
    """
    from llmserve.kernels import get_cpu_kernels
    from llmserve.layers.attention.kv_quant import kv_cache_format
    from llmserve.layers.attention.kv_quant_pc import is_per_channel_key_cache

    kernels = get_cpu_kernels()
    fmt = kv_cache_format(key_cache)
    if kernels is None or not key_cache.is_cpu or query.stride(1) != backend.head_dim or \
            query.dtype not in (torch.float32, torch.bfloat16) or \
            (fmt is None and key_cache.dtype != query.dtype) or \
            is_per_channel_key_cache(key_cache, backend.head_dim):
        return None
    tables = metadata.prompt_scores
    if tables is None:
        tables = metadata.prompt_scores = _prompt_score_tables(metadata, common)
    args = (query, key_cache, value_cache, tables.block_table, tables.seq_lens,
            backend.scale, metadata.sliding_window, torch.get_num_threads(), tables.arrays)
    out = kernels.paged_attention_decode_quant(fmt, *args) if fmt is not None else \
        kernels.paged_attention_decode(*args)
    for req, lo, hi in tables.spans:  # this layer's sums into each request's scores
        n = min(req.scores.shape[0], tables.scratch.shape[1])
        req.scores[:n] += tables.scratch[lo:hi, :n].sum(0)
    tables.scratch.zero_()
    return out

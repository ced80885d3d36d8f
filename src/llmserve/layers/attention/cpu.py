"""The ``"cpu"`` attention backend: a mixed batch in a few torch calls per layer.

``build_metadata`` precomputes, once per step, the block tables, gather
indices and boolean masks of two groups; ``forward`` then runs at most two
``scaled_dot_product_attention`` calls per layer, with no Python loop over
sequences::

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 p1 p1 ]      decodes first, then prefills
               decode group              prefill group
    decode group : float32 / bfloat16 on CPU: one C kernel reads each context's
                   blocks in place (llmserve.kernels, paged_attention_decode);
                   otherwise gather each context by its block table (padded to the
                   longest) -> K/V [num_decodes, max_ctx, Hkv, D]; query heads viewed
                   as [Hkv, group] so K/V are not repeated; padding mask
    prefill group: queries padded to the longest chunk, K/V gathered as above,
                   causal-with-offset mask (+ sliding window); a single prefill
                   without earlier context uses is_causal on this step's K/V

Works in float32, bfloat16 and float16, on CPU and CUDA (all index and mask
tensors live on the block table's device). Algorithm: PagedAttention (Kwon
et al. 2023); grouping as in the vLLM torch SDPA backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmserve.kernels import get_cpu_kernels
from llmserve.layers.attention.backend import AttentionBackend, CommonAttentionMetadata


@dataclass
class CpuAttentionMetadata:
    """Precomputed per-step tensors for :class:`CpuAttentionBackend`."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    num_prefills: int
    # decode group (None when num_decodes == 0)
    decode_block_table: torch.Tensor | None  # [num_decodes, num_decode_blocks]
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64
    # [num_decodes, 1, 1, num_decode_blocks * block_size] bool; built on first use (the C
    # decode kernel needs none)
    decode_mask: torch.Tensor | None
    sliding_window: int | None
    # prefill group
    prefill_is_causal: bool  # single prefill, no earlier context, window inactive
    prefill_block_table: torch.Tensor | None  # [num_prefills, num_prefill_blocks]
    prefill_mask: torch.Tensor | None  # [num_prefills, 1, max_query_len, num_blocks * block_size]
    prefill_query_index: torch.Tensor | None  # [num_prefills, max_query_len], None if one prefill
    prefill_output_index: torch.Tensor | None  # [num_prefill_tokens], None if one prefill
    max_prefill_query_len: int = 0


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _decode_mask(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                 window: int | None) -> torch.Tensor:
    """[num_decodes, 1, 1, num_blocks * block_size] bool: the keys each decode sees."""
    key_pos = torch.arange(block_table.shape[1] * block_size, device=block_table.device)
    seq_lens = seq_lens[:, None]  # [num_decodes, 1]
    mask = key_pos[None, :] < seq_lens  # [num_decodes, max_ctx]
    if window is not None:
        mask &= key_pos[None, :] >= seq_lens - window
    return mask[:, None, None, :]


def _build_prefill(common: CommonAttentionMetadata, window: int | None) -> dict:
    nd = common.num_decodes
    query_lens = common.query_lens[nd:]
    seq_lens_list = common.seq_lens_list[nd:]
    num_prefills = len(query_lens)
    if (num_prefills == 1 and seq_lens_list[0] == query_lens[0]
            and (window is None or seq_lens_list[0] <= window)):
        return {"prefill_is_causal": True}
    device = common.block_table.device
    block_size = common.block_size
    max_q = max(query_lens)
    num_blocks = _ceil_div(max(seq_lens_list), block_size)
    q_lens = torch.tensor(query_lens, dtype=torch.int64, device=device)[:, None]
    seq_lens = common.seq_lens[nd:, None]  # [num_prefills, 1]
    col = torch.arange(max_q, device=device)[None, :]
    # padded query rows repeat the last real query, so no row is fully masked
    col = torch.minimum(col, q_lens - 1)  # [num_prefills, max_q]
    query_pos = (seq_lens - q_lens) + col  # [num_prefills, max_q] absolute positions
    key_pos = torch.arange(num_blocks * block_size, device=device)[None, None, :]
    mask = key_pos <= query_pos[:, :, None]  # [num_prefills, max_q, max_ctx]
    if window is not None:
        mask &= key_pos > query_pos[:, :, None] - window
    out = {
        "prefill_is_causal": False,
        "prefill_block_table": common.block_table[nd:, :num_blocks],
        "prefill_mask": mask[:, None],
        "max_prefill_query_len": max_q,
    }
    if num_prefills > 1:
        starts = common.query_start_loc[nd:-1, None] - nd  # relative to the first prefill token
        out["prefill_query_index"] = starts + col
        num_prefill_tokens = sum(query_lens)
        seq_idx = torch.repeat_interleave(
            torch.arange(num_prefills, device=device), q_lens[:, 0],
            output_size=num_prefill_tokens)  # [num_prefill_tokens]
        token_idx = torch.arange(num_prefill_tokens, device=device)
        out["prefill_output_index"] = seq_idx * max_q + (token_idx - starts[seq_idx, 0])
    return out


class CpuAttentionBackend(AttentionBackend):
    """Grouped SDPA attention over a paged KV cache (see the module docstring)."""

    name = "cpu"

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        """Precompute block tables, gather indices and masks for one step."""
        window = common.sliding_window
        num_decodes = common.num_decodes
        num_prefills = common.num_seqs - num_decodes
        decode_block_table = decode_seq_lens = None
        if num_decodes:
            num_blocks = _ceil_div(max(common.seq_lens_list[:num_decodes]), common.block_size)
            decode_block_table = common.block_table[:num_decodes, :num_blocks]
            decode_seq_lens = common.seq_lens[:num_decodes]
        prefill = _build_prefill(common, window) if num_prefills else {"prefill_is_causal": False}
        return CpuAttentionMetadata(
            slot_mapping=common.slot_mapping, num_decodes=num_decodes,
            num_prefills=num_prefills, decode_block_table=decode_block_table,
            decode_seq_lens=decode_seq_lens, decode_mask=None, sliding_window=window,
            prefill_block_table=prefill.get("prefill_block_table"),
            prefill_mask=prefill.get("prefill_mask"),
            prefill_query_index=prefill.get("prefill_query_index"),
            prefill_output_index=prefill.get("prefill_output_index"),
            prefill_is_causal=prefill["prefill_is_causal"],
            max_prefill_query_len=prefill.get("max_prefill_query_len", 0))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: CpuAttentionMetadata) -> torch.Tensor:
        self.write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        nd = metadata.num_decodes
        if not metadata.num_prefills:
            return self._decode(query, key_cache, value_cache, metadata)
        if not nd:
            return self._prefill(query, key, value, key_cache, value_cache, metadata)
        output = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        output[:nd] = self._decode(query[:nd], key_cache, value_cache, metadata)
        output[nd:] = self._prefill(query[nd:], key[nd:], value[nd:], key_cache,
                                    value_cache, metadata)
        return output

    @staticmethod
    def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """[num_seqs, num_kv_heads, num_blocks * block_size, head_dim] view of each context."""
        num_seqs, num_blocks = block_table.shape
        _, block_size, num_kv_heads, head_dim = cache.shape
        gathered = cache.index_select(0, block_table.reshape(-1))  # [S * nb, bs, Hkv, D]
        return gathered.view(num_seqs, num_blocks * block_size, num_kv_heads,
                             head_dim).transpose(1, 2)

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: CpuAttentionMetadata) -> torch.Tensor:
        nd = query.shape[0]
        kernels = get_cpu_kernels()
        if kernels is not None and key_cache.is_cpu and query.dtype == key_cache.dtype \
                and key_cache.dtype in (torch.float32, torch.bfloat16) \
                and query.stride(1) == self.head_dim:
            return kernels.paged_attention_decode(
                query, key_cache, value_cache, metadata.decode_block_table,
                metadata.decode_seq_lens, self.scale, metadata.sliding_window,
                torch.get_num_threads())
        if metadata.decode_mask is None:  # built once per step, shared by the layers
            metadata.decode_mask = _decode_mask(metadata.decode_block_table,
                                                metadata.decode_seq_lens, key_cache.shape[1],
                                                metadata.sliding_window)
        # [num_decodes, num_kv_heads, num_queries_per_kv, head_dim]: the group plays
        # the role of the query length, so K/V need no repeat
        grouped_query = query.reshape(nd, self.num_kv_heads, self.num_queries_per_kv,
                                      self.head_dim)
        key = self._gather(key_cache, metadata.decode_block_table)  # [nd, Hkv, max_ctx, D]
        value = self._gather(value_cache, metadata.decode_block_table)
        out = F.scaled_dot_product_attention(grouped_query, key, value,
                                             attn_mask=metadata.decode_mask, scale=self.scale)
        return out.reshape(nd, self.num_heads, self.head_dim)

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 metadata: CpuAttentionMetadata) -> torch.Tensor:
        gqa = self.num_queries_per_kv > 1
        if metadata.prefill_is_causal:
            # one fresh prompt: attend over this step's K/V directly
            out = F.scaled_dot_product_attention(
                query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                value.transpose(0, 1)[None], is_causal=True, scale=self.scale, enable_gqa=gqa)
            return out[0].transpose(0, 1)
        if metadata.prefill_query_index is None:
            padded_query = query[None]  # [1, query_len, num_heads, head_dim]
        else:
            padded_query = query[metadata.prefill_query_index]  # [P, max_q, H, D]
        cache_key = self._gather(key_cache, metadata.prefill_block_table)  # [P, Hkv, ctx, D]
        cache_value = self._gather(value_cache, metadata.prefill_block_table)
        out = F.scaled_dot_product_attention(
            padded_query.transpose(1, 2), cache_key, cache_value,
            attn_mask=metadata.prefill_mask, scale=self.scale, enable_gqa=gqa)
        out = out.transpose(1, 2)  # [P, max_q, num_heads, head_dim]
        if metadata.prefill_output_index is None:
            return out[0]
        return out.reshape(-1, self.num_heads, self.head_dim)[metadata.prefill_output_index]

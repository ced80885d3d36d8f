"""The ``"cpu"`` attention backend: decodes in one call, prefills in fixed query tiles.

``build_metadata`` precomputes, once per step, the block tables and masks of
two groups, shared by every layer::

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 p1 p1 ]      decodes first, then prefills
               decode group              prefill group
    decode group : float32 / bfloat16 on CPU: one C kernel reads each context's
                   blocks in place (llmserve.kernels, paged_attention_decode);
                   otherwise gather each context by its block table (padded to the
                   longest) -> K/V [num_decodes, max_ctx, Hkv, D]; query heads viewed
                   as [Hkv, group] so K/V are not repeated; padding mask
    prefill group: K/V written to the cache first, then read back by the block table;
                   the query rows cut into tiles at fixed absolute positions:

        positions   0        32       64       96              (PREFILL_TILE = 32)
        tiles       [  t0   ][  t1   ][  t2   ][  t3   ]
        chunk             [ 20 ........................ 90 ]   rows of t0 < 20, t3 > 90:
                                                               zero padding, dropped
        tile [a, a + 32): one scaled_dot_product_attention of 32 query rows over
                          keys [k0, a + 32), mask key <= query (+ window); k0 = 0, or
                          the window's first block

    so the call that computes a prompt token, its shapes and its mask depend only on
    the token's position: never on where its chunk starts or ends, how much of the
    prompt came from the prefix cache, or the other sequences of the step.

Batch invariance (issue 20): PyTorch's CPU flash attention sums a row in an order
set by the call's query and key lengths (its q/kv split sizes, the causal cut-off of
the last key block), so the old per-chunk call (causal over a fresh prompt's own
K/V, a masked call over the gathered context after a cache hit or an earlier chunk)
gave a token other bits when the prompt was chunked or came partly from the prefix
cache (docs/benchmarks.md). With the tile's shapes fixed, a row's bits are a
function of its query, its keys and values, and its position alone (masked keys add
exact zeros; tests/test_attention.py checks it with garbage in the masked slots).

Works in float32, bfloat16 and float16, on CPU and CUDA (all index and mask
tensors live on the block table's device). Algorithm: PagedAttention (Kwon
et al. 2023); grouping as in the vLLM torch SDPA backend.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmserve.kernels import get_cpu_kernels
from llmserve.kernels.cpu import BlockScoreArrays, CpuKernels
from llmserve.layers.attention.backend import AttentionBackend, CommonAttentionMetadata
from llmserve.layers.attention.cpu_kc import forward_sequential, needs_sequential
from llmserve.layers.attention.kv_quant import dequantize_kv, kv_cache_format
from llmserve.layers.attention.kv_quant_pc import dequantize_key_blocks, is_per_channel_key_cache


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
    # prefill group: one entry per prefill sequence, in token order
    prefills: list[PrefillSeq]
    # the prefills' step-wide gather indices (None when num_prefills == 0)
    prefill_index: PrefillIndex | None = None
    # the step's common metadata: layers with their own window derive (once per step
    # and window, see for_window) the variant with that window's masks
    common: CommonAttentionMetadata | None = None
    variants: dict[int | None, CpuAttentionMetadata] = field(default_factory=dict)
    # a half of split_decodes: (the whole step's metadata, 0 = decodes / 1 = prefills);
    # its window variants are the same half of the whole step's variants
    split_of: tuple[CpuAttentionMetadata, int] | None = None
    # quantized KV (kv_quant.py): each prefill token as a one-token decode, built on first
    # use: (block_table [num_prefill_tokens, W] int64, seq_lens [num_prefill_tokens] int64)
    quant_prefill: tuple[torch.Tensor, torch.Tensor] | None = None
    # KV eviction wants block scores this step (layers/attention/scored.py), or None
    block_scores: dict | None = None
    # [the decode rows' accumulators for the C decode kernels, or None], built on first use
    decode_scores: list | None = None
    # a scored step's prompt rows as one-token decodes (scored.PromptScoreTables)
    prompt_scores: object | None = None

    def for_window(self, window: int | None) -> CpuAttentionMetadata:
        """This step's metadata with sliding window ``window`` (self when it already is),
        built on first use and shared by every layer with that window.

        Raises:
            ValueError: when built without its ``common`` metadata.
        """
        if window == self.sliding_window:
            return self
        variant = self.variants.get(window)
        if variant is None and self.split_of is not None:
            whole, half = self.split_of
            variant = whole.for_window(window).split_decodes()[half]
            self.variants[window] = variant
        if variant is None:
            if self.common is None:
                raise ValueError("CpuAttentionMetadata.for_window needs the common metadata")
            variant = _build_metadata(dataclasses.replace(
                self.common.for_layer_window(window), sliding_window=window))
            self.variants[window] = variant
        return variant

    def step_common(self) -> CommonAttentionMetadata | None:
        """The whole step's common metadata (a half of :meth:`split_decodes` has none)."""
        if self.common is None and self.split_of is not None:
            return self.split_of[0].common
        return self.common

    def decode_score_arrays(self) -> BlockScoreArrays | None:
        """The decode rows' block score accumulators for the C decode kernels
        (``kernels/cpu.py``; a decode row is scored when its ``BlockScoreRequest`` has
        ``first_row <= 0``), built once per step; None when no decode row is scored.

        Raises:
            ValueError: accumulators the kernels cannot take (not float32 on the CPU).
        """
        if self.decode_scores is None:
            reqs = self.block_scores or {}
            arrays = []
            for i in range(self.num_decodes):  # decodes are the step's first sequences
                req = reqs.get(i)
                arrays.append(req.scores if req is not None and req.first_row <= 0 else None)
            self.decode_scores = [CpuKernels.block_score_arrays(arrays)
                                  if any(a is not None for a in arrays) else None]
        return self.decode_scores[0]

    def split_decodes(self) -> tuple[CpuAttentionMetadata, CpuAttentionMetadata]:
        """``(decodes only, prefills only)`` of a mixed step, for running the decode
        rows and the prompt rows as two passes (models/llama.py: a decode then takes
        the same kernels whether or not prompts share its step)."""
        nd = self.num_decodes
        decodes = CpuAttentionMetadata(self.slot_mapping[:nd], nd, 0, self.decode_block_table,
                                       self.decode_seq_lens, self.decode_mask,
                                       self.sliding_window, [])
        prefills = CpuAttentionMetadata(self.slot_mapping[nd:], 0, self.num_prefills, None,
                                        None, None, self.sliding_window, self.prefills,
                                        self.prefill_index)
        decodes.split_of, prefills.split_of = (self, 0), (self, 1)
        decodes.block_scores = prefills.block_scores = self.block_scores
        return decodes, prefills


# query rows per prefill attention call; tiles start at multiples of it (module doc)
PREFILL_TILE = 32


@dataclass
class PrefillTile:
    """One attention call of a prefill: padded query rows ``row_start .. row_start +
    PREFILL_TILE`` of its sequence's tile space over the keys ``key_start .. key_end``."""

    row_start: int
    key_start: int
    key_end: int
    mask: torch.Tensor  # [1, 1, PREFILL_TILE, key_end - key_start] bool, True = attend


@dataclass
class PrefillSeq:
    """One prefill (chunk) of a step; token offsets relative to the first prefill token.

    Its query rows sit at ``row_offset ..`` of a zero-padded tile space of ``num_rows``
    rows (whole tiles, the first at absolute position ``first_tile_pos``); keys come
    from the cache through ``block_table`` (padded with the null block 0 up to the last
    tile's end).
    """

    token_start: int
    token_end: int
    row_offset: int
    num_rows: int
    block_table: torch.Tensor  # [1, num_blocks] int64
    tiles: list[PrefillTile]
    row_base: int = 0  # its first tile row in the step's padded query rows
    key_base: int = 0  # its first key in the step's gathered K/V


@dataclass
class PrefillIndex:
    """All prefills of a step gathered at once (one op each per layer, not per prefill).

    ``rows`` picks the padded query rows from ``[prefill tokens | one zero row]``;
    ``block_table`` lists every prefill's blocks in turn; ``outputs`` picks each token's
    row from the tiles' outputs concatenated in order.
    """

    rows: torch.Tensor  # [total_tile_rows] int64
    block_table: torch.Tensor  # [1, total_blocks] int64
    outputs: torch.Tensor  # [num_prefill_tokens] int64


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


def _tile_mask(tile_pos: int, key_start: int, window: int | None,
               device: torch.device) -> torch.Tensor:
    """[1, 1, PREFILL_TILE, tile_pos + PREFILL_TILE - key_start] bool: causal (+ window)."""
    query_pos = torch.arange(tile_pos, tile_pos + PREFILL_TILE, device=device)[:, None]
    key_pos = torch.arange(key_start, tile_pos + PREFILL_TILE, device=device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask[None, None]


def _build_prefills(common: CommonAttentionMetadata, window: int | None) -> list[PrefillSeq]:
    """Per prefill: its token range, its place in the fixed tiles, its block table and
    the tiles' key ranges and masks (shared between sequences: keyed by position)."""
    nd = common.num_decodes
    device = common.block_table.device
    block_size = common.block_size
    width = common.block_table.shape[1]
    masks: dict[tuple[int, int], torch.Tensor] = {}
    prefills, start = [], 0
    for i in range(nd, common.num_seqs):
        q_len, seq_len = common.query_lens[i], common.seq_lens_list[i]
        end = start + q_len
        first = (seq_len - q_len) // PREFILL_TILE * PREFILL_TILE  # first tile's position
        last = _ceil_div(seq_len, PREFILL_TILE) * PREFILL_TILE  # last tile's end
        num_blocks = _ceil_div(last, block_size)
        table = common.block_table[i:i + 1, :min(num_blocks, width)]
        if table.shape[1] < num_blocks:  # keys past the context: the null block, masked
            table = torch.cat([table, table.new_zeros(1, num_blocks - table.shape[1])], 1)
        tiles = []
        for pos in range(first, last, PREFILL_TILE):
            key_start = 0
            if window is not None:  # the first block any row of the tile can see
                key_start = max(0, pos - window + 1) // block_size * block_size
            mask = masks.get((pos, key_start))
            if mask is None:
                mask = masks[(pos, key_start)] = _tile_mask(pos, key_start, window, device)
            tiles.append(PrefillTile(pos - first, key_start, pos + PREFILL_TILE, mask))
        prefills.append(PrefillSeq(start, end, seq_len - q_len - first, last - first, table,
                                   tiles))
        start = end
    return prefills


def _build_prefill_index(prefills: list[PrefillSeq], block_size: int) -> PrefillIndex:
    """Set each prefill's ``row_base`` / ``key_base``; the step's gather indices."""
    num_tokens = prefills[-1].token_end if prefills else 0
    rows, outputs = [], []
    row_base = key_base = 0
    for p in prefills:
        p.row_base, p.key_base = row_base, key_base
        n = p.token_end - p.token_start
        row = torch.full((p.num_rows,), num_tokens, dtype=torch.int64)  # the zero row
        row[p.row_offset:p.row_offset + n] = torch.arange(p.token_start, p.token_end)
        rows.append(row)
        outputs.append(torch.arange(n) + row_base + p.row_offset)
        row_base += p.num_rows
        key_base += p.block_table.shape[1] * block_size
    device = prefills[0].block_table.device
    return PrefillIndex(torch.cat(rows).to(device),
                        torch.cat([p.block_table for p in prefills], 1),
                        torch.cat(outputs).to(device))


def _build_metadata(common: CommonAttentionMetadata) -> CpuAttentionMetadata:
    window = common.sliding_window
    num_decodes = common.num_decodes
    num_prefills = common.num_seqs - num_decodes
    decode_block_table = decode_seq_lens = None
    prefills = _build_prefills(common, window) if num_prefills else []
    if num_decodes:
        num_blocks = _ceil_div(max(common.seq_lens_list[:num_decodes]), common.block_size)
        decode_block_table = common.block_table[:num_decodes, :num_blocks]
        decode_seq_lens = common.seq_lens[:num_decodes]
    return CpuAttentionMetadata(
        slot_mapping=common.slot_mapping, num_decodes=num_decodes,
        num_prefills=num_prefills, decode_block_table=decode_block_table,
        decode_seq_lens=decode_seq_lens, decode_mask=None, sliding_window=window,
        prefills=prefills, prefill_index=_build_prefill_index(prefills, common.block_size)
        if prefills else None, common=common, block_scores=common.block_scores)


class CpuAttentionBackend(AttentionBackend):
    """Grouped SDPA attention over a paged KV cache (see the module docstring)."""

    name = "cpu"

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        """Precompute block tables, gather indices and masks for one step."""
        return _build_metadata(common)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: CpuAttentionMetadata) -> torch.Tensor:
        if metadata.block_scores is not None and metadata.step_common() is not None:
            from llmserve.layers.attention.scored import cpu_scored_forward  # KV eviction

            return cpu_scored_forward(self, query, key, value, key_cache, value_cache, metadata)
        if self.sliding_window is not None:  # this layer's own window
            metadata = metadata.for_window(self.sliding_window)
        if is_per_channel_key_cache(key_cache, self.head_dim) and \
                needs_sequential(metadata, value_cache.shape[1]):  # token by token
            return forward_sequential(self, get_cpu_kernels(), query, key, value, key_cache,
                                      value_cache, metadata)
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

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """[num_seqs, num_kv_heads, num_blocks * block_size, head_dim] view of each context
        (in ``dtype``: a quantized or other-dtype cache is dequantized / cast after the
        gather, the fallback where the C kernels do not apply)."""
        num_seqs, num_blocks = block_table.shape
        gathered = cache.index_select(0, block_table.reshape(-1))  # [S * nb, bs, Hkv, D]
        if is_per_channel_key_cache(gathered, self.head_dim):  # [S * nb, bs + 2, Hkv, D]
            gathered = dequantize_key_blocks(gathered, dtype or torch.float32)
        elif dtype is not None and gathered.dtype != dtype:
            gathered = dequantize_kv(gathered, dtype)
        _, block_size, num_kv_heads, head_dim = gathered.shape
        return gathered.view(num_seqs, num_blocks * block_size, num_kv_heads,
                             head_dim).transpose(1, 2)

    def _decode_kernel(self, query: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, metadata: CpuAttentionMetadata,
                       block_scores: BlockScoreArrays | None = None) -> torch.Tensor | None:
        """The decode rows through the C decode kernels (``block_scores``: their score
        accumulators), or None where the kernels do not apply."""
        kernels = get_cpu_kernels()
        if kernels is None or not key_cache.is_cpu or query.stride(1) != self.head_dim:
            return None
        fmt = kv_cache_format(key_cache)
        if fmt is not None and query.dtype in (torch.float32, torch.bfloat16):
            return kernels.paged_attention_decode_quant(  # rows dequantized in the loop
                fmt, query, key_cache, value_cache, metadata.decode_block_table,
                metadata.decode_seq_lens, self.scale, metadata.sliding_window,
                torch.get_num_threads(), block_scores)
        if query.dtype == key_cache.dtype and key_cache.dtype in (torch.float32, torch.bfloat16):
            return kernels.paged_attention_decode(
                query, key_cache, value_cache, metadata.decode_block_table,
                metadata.decode_seq_lens, self.scale, metadata.sliding_window,
                torch.get_num_threads(), block_scores)
        return None

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: CpuAttentionMetadata) -> torch.Tensor:
        nd = query.shape[0]
        out = self._decode_kernel(query, key_cache, value_cache, metadata)
        if out is not None:
            return out
        if metadata.decode_mask is None:  # built once per step, shared by the layers
            metadata.decode_mask = _decode_mask(metadata.decode_block_table,
                                                metadata.decode_seq_lens, value_cache.shape[1],
                                                metadata.sliding_window)
        # [num_decodes, num_kv_heads, num_queries_per_kv, head_dim]: the group plays
        # the role of the query length, so K/V need no repeat
        grouped_query = query.reshape(nd, self.num_kv_heads, self.num_queries_per_kv,
                                      self.head_dim)
        # [nd, Hkv, max_ctx, D]
        key = self._gather(key_cache, metadata.decode_block_table, query.dtype)
        value = self._gather(value_cache, metadata.decode_block_table, query.dtype)
        out = F.scaled_dot_product_attention(grouped_query, key, value,
                                             attn_mask=metadata.decode_mask, scale=self.scale)
        return out.reshape(nd, self.num_heads, self.head_dim)

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 metadata: CpuAttentionMetadata) -> torch.Tensor:
        """Each prefill's query rows in fixed tiles over its cached K/V (module doc):
        one SDPA call per tile, the same shapes and mask for a token wherever its chunk
        starts. (``key``/``value`` are in the cache already; they are read from there.)"""
        kernels = get_cpu_kernels()
        if kv_cache_format(key_cache) is not None and kernels is not None \
                and key_cache.is_cpu and query.dtype in (torch.float32, torch.bfloat16) \
                and query.stride(1) == self.head_dim:
            return self._prefill_quant(kernels, query, key_cache, value_cache, metadata)
        gqa = self.num_queries_per_kv > 1
        index = metadata.prefill_index
        # [1, H, total_tile_rows, D]: every chunk's rows at their place in its tiles
        q = F.pad(query, (0, 0, 0, 0, 0, 1)).index_select(0, index.rows).transpose(0, 1)[None]
        k = self._gather(key_cache, index.block_table, query.dtype)  # [1, Hkv, total_keys, D]
        v = self._gather(value_cache, index.block_table, query.dtype)
        outs = []
        for p in metadata.prefills:
            for t in p.tiles:
                rows, keys = p.row_base + t.row_start, p.key_base + t.key_start
                outs.append(F.scaled_dot_product_attention(
                    q[:, :, rows:rows + PREFILL_TILE],
                    k[:, :, keys:p.key_base + t.key_end], v[:, :, keys:p.key_base + t.key_end],
                    attn_mask=t.mask, scale=self.scale, enable_gqa=gqa))  # [1, H, TILE, D]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
        # [num_prefill_tokens, num_heads, head_dim]
        return out[0].transpose(0, 1).index_select(0, index.outputs)

    def _prefill_quant(self, kernels, query: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor,
                       metadata: CpuAttentionMetadata) -> torch.Tensor:
        """Prompt rows over a quantized cache: each token as a one-token decode of its
        own context (seq_len = position + 1) through the quantized C decode kernel, which
        dequantizes row by row; a token's result depends on its position and context
        only (never on its chunk), as the tiles of the float path."""
        if metadata.quant_prefill is None:  # built once per step, shared by the layers
            metadata.quant_prefill = _quant_prefill_tables(metadata.prefills)
        block_table, seq_lens = metadata.quant_prefill
        return kernels.paged_attention_decode_quant(
            kv_cache_format(key_cache), query, key_cache, value_cache, block_table, seq_lens,
            self.scale, metadata.sliding_window, torch.get_num_threads())


def _quant_prefill_tables(prefills: list[PrefillSeq]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prefill token: its sequence's block table row and ``position + 1``."""
    width = max(p.block_table.shape[1] for p in prefills)
    tables, lens = [], []
    for p in prefills:
        n = p.token_end - p.token_start
        start = p.tiles[0].key_end - PREFILL_TILE + p.row_offset  # first token's position
        table = p.block_table
        if table.shape[1] < width:
            table = torch.cat([table, table.new_zeros(1, width - table.shape[1])], 1)
        tables.append(table.expand(n, width))
        lens.append(torch.arange(start + 1, start + n + 1, dtype=torch.int64,
                                 device=table.device))
    return torch.cat(tables).contiguous(), torch.cat(lens)

"""Paged-KV attention backend interface (PagedAttention, Kwon et al. 2023).

The model runner builds one :class:`CommonAttentionMetadata` per engine step;
each backend turns it once into its own metadata (``build_metadata``), which
every attention layer of the model then receives as an argument (no global
"current context" object).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from llmserve.kernels import get_cpu_kernels
from llmserve.layers.attention.kv_quant import kv_cache_format, write_kv_quant


@dataclass
class WindowLayout:
    """Where a mixed model's local layers keep their KV this step: the window pool of
    ``kv_cache/window_blocks.py``, with its own block table (``0``, the null block, where
    a block slid out; those positions are outside the window of every query here)."""

    window: int  # the local layers' sliding window, tokens
    block_table: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int64, window-pool ids
    slot_mapping: torch.Tensor  # [num_tokens] int64, window-pool slots


@dataclass
class CommonAttentionMetadata:
    """Per-step description of the flattened batch, shared by all layers.

    Sequences are ordered: decodes (``query_len == 1``) first, then prefills
    or prefill chunks (``query_len >= 1``, earlier context allowed). The
    query tokens of all sequences are concatenated in that order into one
    dimension of ``num_tokens`` (no batch dimension, no padding).

    For sequence ``i`` with ``L = seq_lens[i]`` and ``q = query_lens[i]``,
    this step's tokens are the positions ``L - q .. L - 1``; positions
    ``0 .. L - q - 1`` are already in the KV cache.
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int64, context length after this step
    block_table: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token's K/V
    query_lens: list[int]
    seq_lens_list: list[int]
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    # A token attends to at most the last `sliding_window` positions, itself
    # included (Hugging Face Mistral semantics: key_pos > query_pos - window).
    sliding_window: int | None = None
    # KV eviction by attention: {sequence index: scored.BlockScoreRequest}; when set the
    # step's attention sums block scores (layers/attention/scored.py; on the "cpu" backend
    # decode rows sum them in the C decode kernels)
    block_scores: dict | None = None
    # a mixed model's local layers keep their KV in a window pool (WindowLayout), or None
    window_layout: WindowLayout | None = None

    def for_layer_window(self, window: int | None) -> CommonAttentionMetadata:
        """The metadata a layer with sliding window ``window`` reads: the window pool's
        block table and slots when this step has a :class:`WindowLayout` for that window,
        else ``self``."""
        layout = self.window_layout
        if layout is None or window != layout.window:
            return self
        return dataclasses.replace(self, block_table=layout.block_table,
                                   slot_mapping=layout.slot_mapping, window_layout=None)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        """Decodes come first and have one token each."""
        return self.num_decodes

    @classmethod
    def from_lists(cls, query_lens: list[int], seq_lens: list[int],
                   block_tables: list[list[int]], block_size: int,
                   sliding_window: int | None = None,
                   device: torch.device | str = "cpu") -> CommonAttentionMetadata:
        """Build the tensors from plain per-sequence lists.

        ``num_decodes`` counts the leading sequences with ``query_len == 1``
        (a later 1-token chunk is simply handled as a prefill).
        ``slot_mapping`` is derived from the block tables: the token at
        position ``p`` goes to ``block_table[p // block_size] * block_size
        + p % block_size``.

        Raises:
            ValueError: when a query is empty or longer than its context, or
                a block table is too short for its context.
        """
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        slots: list[int] = []
        for i, (q, s, blocks) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
            if q < 1 or q > s:
                raise ValueError(f"sequence {i}: need 1 <= query_len ({q}) <= seq_len ({s})")
            if len(blocks) * block_size < s:
                raise ValueError(f"sequence {i}: {len(blocks)} blocks cannot hold {s} tokens")
            slots.extend(blocks[p // block_size] * block_size + p % block_size
                         for p in range(s - q, s))
        width = max((len(b) for b in block_tables), default=0) or 1
        table = [b + [0] * (width - len(b)) for b in block_tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)

        def as_tensor(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(
            query_start_loc=as_tensor(starts), seq_lens=as_tensor(list(seq_lens)),
            block_table=as_tensor(table).view(len(block_tables), width),
            slot_mapping=as_tensor(slots), query_lens=list(query_lens),
            seq_lens_list=list(seq_lens), num_decodes=num_decodes,
            max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0),
            block_size=block_size, sliding_window=sliding_window)


class AttentionBackend(ABC):
    """Causal self-attention over a paged KV cache.

    KV cache layout (per layer, one tensor for keys and one for values)::

        key_cache: [num_blocks, block_size, num_kv_heads, head_dim]

          block 0        block 1        block 2        ...
        +--+--+--+--+  +--+--+--+--+  +--+--+--+--+
        |s0|s1|s2|s3|  |s4|s5|s6|s7|  |s8|..|..|..|     slot = block_id * block_size + offset
        +--+--+--+--+  +--+--+--+--+  +--+--+--+--+

        sequence with block_table = [2, 0]:
          position p  ->  block_table[p // block_size], offset p % block_size
          positions 0..3 live in block 2, positions 4..7 in block 0

    Invariants every implementation keeps:

    * ``forward`` first writes this step's ``key``/``value`` into the caches
      at ``slot_mapping`` (in place), then computes attention, so a token
      sees its own K/V and those of the earlier tokens of the same step.
    * Query token at position ``p`` of a sequence attends to the key
      positions ``k`` with ``k <= p`` (and ``k > p - W`` when a window ``W`` is
      set: the layer's own ``sliding_window``, else the step's), the earlier
      ones read from the cache through the
      sequence's ``block_table``. Sequences never see each other.
    * Grouped-query attention: query head ``h`` uses KV head
      ``h // (num_heads // num_kv_heads)``.
    * Scores are ``scale * q . k``; the softmax is computed in (at least)
      float32 precision; the output has the query's dtype.
    * ``build_metadata`` is called once per step and its result is shared by
      all layers; it must not depend on a layer's tensors.
    """

    name: ClassVar[str]

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None) -> None:
        """``sliding_window``: this layer's own window (per-layer windows, e.g. Gemma 3's
        sliding layers); None: the step's ``sliding_window`` (model-wide, e.g. Mistral).

        Raises ValueError when ``num_heads`` is not a multiple of ``num_kv_heads``, or
        for a window < 1.
        """
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a positive multiple of "
                f"num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.scale = float(scale)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window

    def layer_window(self, step_window: int | None) -> int | None:
        """The window this layer applies in a step whose metadata says ``step_window``."""
        return step_window if self.sliding_window is None else self.sliding_window

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> Any:
        """Backend-specific metadata for one step (default: ``common`` itself)."""
        return common

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_dim: int) -> tuple[int, int, int, int]:
        """Shape of one layer's key (or value) cache."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at
        ``slot_mapping`` ``[num_tokens]`` in the caches (in place).

        Raises RuntimeError when a cache is not contiguous (a flat view is needed).
        """
        if slot_mapping.numel() == 0:
            return
        kernels = get_cpu_kernels()
        fmt = kv_cache_format(key_cache)
        if fmt is not None:  # quantized pages (kv_quant.py): quantize on write
            if kernels is not None and key_cache.is_cpu \
                    and key.dtype in (torch.float32, torch.bfloat16) \
                    and value.dtype == key.dtype and key.stride()[1:] == (key.shape[2], 1) \
                    and value.stride()[1:] == (value.shape[2], 1):
                kernels.write_kv_quant(fmt, key, value, key_cache, value_cache, slot_mapping)
            else:
                write_kv_quant(key, value, key_cache, value_cache, slot_mapping)
            return
        if kernels is not None and key_cache.is_cpu and key.dtype == key_cache.dtype \
                and key_cache.dtype in (torch.float32, torch.bfloat16) \
                and key.stride(1) == key.shape[2] and value.stride(1) == value.shape[2]:
            kernels.write_kv(key, value, key_cache, value_cache, slot_mapping)  # one C call
            return
        num_kv_heads, head_dim = key_cache.shape[-2:]
        flat_key_cache = key_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        flat_value_cache = value_cache.view(-1, num_kv_heads, head_dim)
        flat_key_cache.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
        flat_value_cache.index_copy_(0, slot_mapping, value.to(value_cache.dtype))

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        """Write K/V into the cache, then attend.

        Args:
            query: ``[num_tokens, num_heads, head_dim]``.
            key, value: ``[num_tokens, num_kv_heads, head_dim]`` (RoPE applied).
            key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
            metadata: what ``build_metadata`` returned for this step.

        Returns:
            ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.
        """

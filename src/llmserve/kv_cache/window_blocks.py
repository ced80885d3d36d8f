"""Blocks of a mixed model's sliding-window layers, freed as they slide out.

A model whose layers mix sliding-window ("local") and full ("global") attention, such as
Gemma 3 (five local layers per global one) or Qwen2 with ``max_window_layers``, keeps
its KV cache in two pools when this is on::

    full pool   (KVCacheManager.block_pool)  a block: block_size tokens of every global layer
    window pool (WindowBlocks.pool)          a block: block_size tokens of every local layer

A request's global layers use its block table as before (every token). Its local layers
use a second table that holds only the blocks a query of this step or a later one can
still read. A step's first query sits at ``num_computed_tokens`` and sees keys
``k > num_computed_tokens - W``, so every logical block before
``(num_computed_tokens - W + 1) // block_size`` is returned to the window pool when the
next step allocates::

    logical block:   0   1   2   3   4   5   6
    global table:   [7,  3,  9, 12,  4,  8, 11]
    local table:            [2,  6,  1,  5]        first = 2 (blocks 0-1 slid out)

A sequence then holds at most ``ceil((W + chunk) / block_size) + 1`` window blocks,
whatever its length, and a long conversation costs the global layers' bytes per token
only.

Not combined with prefix caching (a cached prefix would lack its local layers' last
window), swap preemption, KV eviction, forks of ``n > 1`` or speculative decoding; the
engine keeps one pool for every layer then (:func:`window_kv_layout` says why).

Source: vLLM v1's hybrid KV cache manager (one block table per KV cache group;
``SlidingWindowManager.remove_skipped_blocks``), here as two pools sized at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmserve.kv_cache.block_pool import BlockPool, KVCacheBlock
from llmserve.utils import cdiv


@dataclass(frozen=True)
class WindowKVLayout:
    """Which layers keep their KV in the window pool, and its size.

    ``window``: the local layers' window in tokens (they all share it);
    ``layers``: their indices; ``num_blocks``: blocks of the window pool (block 0 is the
    null block); ``blocks_per_seq``: the most window blocks one sequence holds in a step.
    """

    window: int
    layers: tuple[int, ...]
    num_blocks: int
    blocks_per_seq: int


def window_kv_layout(layer_windows: list[int | None], block_size: int, max_num_seqs: int,
                     max_num_batched_tokens: int, conflicts: list[str],
                     ) -> tuple[WindowKVLayout | None, str]:
    """The two-pool layout for a model whose layers have windows ``layer_windows``
    (None: global), or ``(None, why not)`` (``""`` when the model is not mixed).

    The window pool holds ``max_num_seqs`` full windows plus one step's tokens, so every
    running sequence always finds its window blocks:
    ``sum_i (ceil((W + c_i) / bs) + 1) <= n (W / bs + 2) + C / bs`` for chunks ``c_i``
    summing to at most ``C = max_num_batched_tokens`` (the engine may cap it by memory,
    ``worker/window_kv.py``; then a step that finds too few waits or preempts).

    Args:
        conflicts: features that are on and need one pool (their names), e.g.
            ``["prefix caching"]``; any of them keeps one pool.
    """
    local = [i for i, w in enumerate(layer_windows) if w is not None]
    if not local or len(local) == len(layer_windows):
        return None, ""  # not a mixed model
    windows = {layer_windows[i] for i in local}
    if len(windows) > 1:
        return None, f"the local layers have different windows {sorted(windows)}"
    if conflicts:
        return None, " and ".join(conflicts) + " need every layer's blocks"
    window = windows.pop()
    per_seq = cdiv(window + max_num_batched_tokens, block_size) + 1
    num_blocks = max_num_seqs * (cdiv(window, block_size) + 2) \
        + cdiv(max_num_batched_tokens, block_size) + 1
    return WindowKVLayout(window, tuple(local), max(num_blocks, per_seq + 1), per_seq), ""


# the window pool takes at most this share of the KV memory (but always one sequence's
# blocks); a smaller pool makes the scheduler wait or preempt instead
MAX_WINDOW_POOL_SHARE = 0.5


def cap_window_pool(layout: WindowKVLayout, bytes_per_block: int,
                    kv_memory: int) -> WindowKVLayout:
    """``layout`` with at most :data:`MAX_WINDOW_POOL_SHARE` of ``kv_memory`` bytes of
    window blocks (``bytes_per_block``: one block of every local layer), never fewer
    than one sequence's ``blocks_per_seq + 1``."""
    cap = int(max(kv_memory, 0) * MAX_WINDOW_POOL_SHARE) // bytes_per_block
    if layout.num_blocks <= cap:
        return layout
    return replace(layout, num_blocks=max(layout.blocks_per_seq + 1, cap))


class WindowBlocks:
    """Per-request tables of the window pool (see the module docstring). Pure Python.

    Args:
        num_blocks: blocks of the window pool (block 0: null).
        block_size: tokens per block.
        window: the local layers' window ``W`` in tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.window = window
        self.first: dict[str, int] = {}  # request -> logical index of its first kept block
        self.tables: dict[str, list[KVCacheBlock]] = {}

    def _plan(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
              ) -> tuple[int, int, int]:
        """(dead blocks to free, new first index, blocks to allocate)."""
        bs = self.block_size
        table = self.tables.get(request_id)
        if table is None and num_computed_tokens > 0:
            raise RuntimeError(
                f"request {request_id!r} has {num_computed_tokens} computed tokens but no "
                "window blocks (a prefix hit or fork in two-pool mode)")
        lo = max(0, num_computed_tokens - self.window + 1) // bs
        first = self.first.get(request_id, lo) if table else lo
        end = first + len(table or ())
        dead = min(max(0, lo - first), len(table or ()))
        new_first = max(first, lo)
        need = max(0, cdiv(num_computed_tokens + num_new_tokens, bs) - max(end, lo))
        return dead, new_first, need

    def can_allocate(self, request_id: str, num_computed_tokens: int,
                     num_new_tokens: int) -> bool:
        """Whether :meth:`allocate` would succeed."""
        dead, _, need = self._plan(request_id, num_computed_tokens, num_new_tokens)
        return need <= self.pool.get_num_free_blocks() + dead

    def allocate(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> None:
        """Free the blocks that slid out before ``num_computed_tokens`` and add those the
        step's ``num_new_tokens`` tokens are written to.

        Raises:
            RuntimeError: too few free blocks (check :meth:`can_allocate` first), or a
                request with computed tokens and no table.
        """
        dead, new_first, need = self._plan(request_id, num_computed_tokens, num_new_tokens)
        table = self.tables.setdefault(request_id, [])
        if dead:
            self.pool.free_blocks(list(reversed(table[:dead])))
            del table[:dead]
        if need > self.pool.get_num_free_blocks():
            raise RuntimeError(f"window pool: {need} blocks needed, "
                               f"{self.pool.get_num_free_blocks()} free")
        self.first[request_id] = new_first
        table.extend(self.pool.get_new_blocks(need))

    def free(self, request_id: str) -> None:
        """Return every window block of ``request_id`` (no-op if it has none)."""
        table = self.tables.pop(request_id, None)
        self.first.pop(request_id, None)
        if table:
            self.pool.free_blocks(list(reversed(table)))

    def get(self, request_id: str) -> tuple[int, list[int]]:
        """``(logical index of the first block, block ids)`` of ``request_id``."""
        return self.first.get(request_id, 0), [b.block_id for b in
                                               self.tables.get(request_id, ())]

    def num_held(self) -> int:
        """Window blocks held by requests."""
        return self.pool.num_usable_blocks - self.pool.get_num_free_blocks()

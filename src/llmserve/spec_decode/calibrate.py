"""Start-up timing of verification and draft steps for the adaptive draft-length policy.

The adaptive policy (``policy.py``) weighs one more draft against what one more
verified row and one more draft forward cost at the current batch size. Left to learn
those costs online, each batch-size bucket runs on priors until it has timed 8 of its
own steps, and on a CPU whose int8 kernels turn compute bound at a few rows, those
steps (4 requests x 5 verified rows) cost several plain decode steps: the adaptive
policy ran at 0.86-0.96x of plain decoding at batch 4 (docs/benchmarks.md). So the
engine times dummy steps once at start-up, as vLLM's profile run does for memory::

    one warm-up forward, then for B in 1, 2, 4, 8 (<= max_num_seqs):
        for k in 0, 1, k_max:      target forward + logits, B * (k + 1) one-token rows
        draft model only:          draft forward + logits, B one-token rows

and feeds the times to :class:`~llmserve.spec_decode.policy.StepCostModel` as if
they were steps (real steps then keep refining the fit). The goodput guard
(``goodput.py``) takes real steps only: dummy steps leave out the engine's own work. A ``block_size``-token
context is prefilled into block 0 first, and every dummy row is the one-token decode
after it (slot 0 of block 1): no request holds a block yet, and a block's slots are
written before any query reads them (what the dummy steps leave is never read).
"""

from __future__ import annotations

import logging
import time
from itertools import accumulate

import torch

from llmserve.layers.attention import CommonAttentionMetadata

logger = logging.getLogger(__name__)
MAX_BATCH = 8  # larger buckets learn online (from the priors): 16 x 5 rows take long


def _metadata(model, query_lens: list[int], seq_len: int, block_size: int, device):
    """Attention metadata for sequences that all read blocks 0 and 1 (``seq_len <=
    2 * block_size``), the new tokens at the end of each."""
    rows = len(query_lens)
    slots = [t for q in query_lens for t in range(seq_len - q, seq_len)]
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + list(accumulate(query_lens)), dtype=torch.long,
                                     device=device),
        seq_lens=torch.full((rows,), seq_len, dtype=torch.long, device=device),
        block_table=torch.tensor([[0, 1]] * rows, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_lens=list(query_lens), seq_lens_list=[seq_len] * rows,
        num_decodes=sum(q == 1 for q in query_lens), max_query_len=max(query_lens),
        max_seq_len=seq_len, block_size=block_size,
        sliding_window=getattr(model, "sliding_window", None))
    return model.attn_backend_cls.build_metadata(common)


@torch.inference_mode()
def prefill_context(model: torch.nn.Module, kv_caches, block_size: int, device) -> None:
    """Write a ``block_size``-token context (ids 100 .. 100 + block_size - 1) into block
    0, so that the dummy decode rows read a real first token (module doc)."""
    ids = torch.arange(100, 100 + block_size, dtype=torch.long, device=device)
    positions = torch.arange(block_size, dtype=torch.long, device=device)
    model(ids, positions, kv_caches, _metadata(model, [block_size], block_size, block_size,
                                               device))


@torch.inference_mode()
def time_decode_rows(model: torch.nn.Module, kv_caches, rows: int, block_size: int,
                     device) -> float:
    """Seconds for ``model`` to run ``rows`` one-token decode rows and their logits: each
    row the token after :func:`prefill_context`'s (slot 0 of block 1).

    Not a row at position 0: a sequence's first token carries the "massive activations"
    (Qwen2: hundreds of times a row's mean) for which the int8 kernels run a second
    pass; measured on Qwen2.5-Coder-1.5B, such rows made 5 rows look 1.8x one row."""
    ids = torch.full((rows,), 100 + block_size, dtype=torch.long, device=device)
    positions = torch.full((rows,), block_size, dtype=torch.long, device=device)
    t0 = time.perf_counter()
    metadata = _metadata(model, [1] * rows, block_size + 1, block_size, device)
    hidden = model(ids, positions, kv_caches, metadata)
    model.compute_logits(hidden).argmax(dim=-1).tolist()
    return time.perf_counter() - t0


def calibrate_step_costs(spec_decoder, runner, max_num_seqs: int) -> None:
    """Seed ``spec_decoder.policy.cost_model`` with timed dummy steps (module doc)."""
    policy, proposer = spec_decoder.policy, spec_decoder.proposer
    ks = sorted({0, 1, policy.k_max})
    draft = getattr(proposer, "model", None)
    t0 = time.perf_counter()
    prefill_context(runner.model, runner.kv_caches, runner.block_size, runner.device)
    if draft is not None:
        prefill_context(draft, proposer.kv_caches, runner.block_size, runner.device)
    time_decode_rows(runner.model, runner.kv_caches, 1, runner.block_size, runner.device)
    batch = 1
    while batch <= min(max_num_seqs, MAX_BATCH):
        for k in ks:
            rows = batch * (k + 1)
            seconds = time_decode_rows(runner.model, runner.kv_caches, rows,
                                       runner.block_size, runner.device)
            for _ in range(-(-policy.cost_model.MIN_STEPS // len(ks))):
                policy.cost_model.observe_step(rows, seconds, batch)
        seconds = 0.0  # n-gram lookup: free next to a forward (real steps refine it)
        if draft is not None:  # the median of 3: one forward of a small model is noisy
            seconds = sorted(time_decode_rows(draft, proposer.kv_caches, batch,
                                              runner.block_size, runner.device)
                             for _ in range(3))[1]
        policy.cost_model.observe_draft(1, seconds, batch)
        batch *= 2
    costs = {b: policy.cost_model.relative_cost(b) for b in (1, 2, 4, 8)
             if b <= min(max_num_seqs, MAX_BATCH)}
    logger.info("speculative decoding: timed start-up steps in %.1f s; one more draft "
                "costs %s of a decode step by batch size", time.perf_counter() - t0,
                {b: None if c is None else round(c, 2) for b, c in costs.items()})

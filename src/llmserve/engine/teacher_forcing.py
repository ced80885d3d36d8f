"""Teacher-forced decoding through the engine: the full next-token distribution at each
position of a fixed token sequence, computed the way the engine computes generated tokens.

A text ``t_0 .. t_{N-1}`` runs as one greedy request: the prompt ``t_0 .. t_{P-1}``
(one prefill chunk when ``max_num_batched_tokens >= P``), then decode steps of one token
each. For the run, the model's ``compute_logits`` is wrapped: it hands the raw logits
row to a callback, then returns logits whose only finite entry is the text's next token,
so the greedy sampler "samples" the text. Everything else is the engine's own: the
scheduler, the KV cache dtype (quantized pages), the eviction policy and budget (which
evict before each step's slots are allocated, so evicted blocks are gone from the
attention of every later step), the attention kernels::

    row k = 0          prefill's last position P-1   -> predicts t_P
    row k >= 1         decode step at position P-1+k -> predicts t_{P+k}, reading the KV
                       cache as the engine holds it then (kept blocks only, after eviction)

Why not ``prompt_logprobs``: they give the top-k only (no full distribution for KL), and
a prompt is not evicted while its chunk runs (SnapKV waits for the whole prompt), so a
prefill-only evaluation never sees the evicted cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class TeacherForcedRun:
    """What one run saw. ``evicted_tokens[k]``: tokens the request had evicted when row
    ``k`` was computed (0 without eviction); ``num_kept_blocks[k]``: blocks it held."""

    num_rows: int = 0
    evicted_tokens: list[int] = field(default_factory=list)
    num_kept_blocks: list[int] = field(default_factory=list)

    def first_evicted_row(self) -> int | None:
        """The first row computed after an eviction, or None if nothing was evicted."""
        return next((k for k, e in enumerate(self.evicted_tokens) if e > 0), None)


def teacher_forced(engine, token_ids: list[int], prompt_len: int,
                   on_logits: Callable[[int, torch.Tensor], None], params=None,
                   request_id: str = "teacher-forced") -> TeacherForcedRun:
    """Run ``token_ids`` through ``engine`` (an idle :class:`LLMEngine`) teacher-forced.

    Args:
        engine: in-process engine, no speculative decoding, no other requests.
        token_ids: the text, ``N`` token ids.
        prompt_len: ``P``, ``1 <= P < N``: tokens computed as the prompt.
        on_logits: called as ``on_logits(k, logits)`` for ``k = 0 .. N-P-1``, ``logits``
            ``[vocab_size]`` float32 (raw, before any sampling step), predicting
            ``token_ids[P + k]``.
        params: :class:`SamplingParams` whose eviction fields are used (policy, budget,
            sinks); the sampling fields are replaced (greedy, ``N - P`` tokens, no EOS).

    Returns:
        A :class:`TeacherForcedRun` with ``N - P`` rows.

    Raises:
        ValueError: a bad ``prompt_len``, a busy engine, speculative decoding, or
            ``prompt_logprobs`` in ``params``.
    """
    from llmserve.sampling_params import SamplingParams

    n = len(token_ids)
    if not 1 <= prompt_len < n:
        raise ValueError(f"prompt_len must be in [1, {n - 1}], got {prompt_len}")
    if engine.has_unfinished_requests():
        raise ValueError("teacher_forced needs an idle engine (it wraps the model's logits)")
    if getattr(engine.runner, "spec_decoder", None) is not None:
        raise ValueError("teacher_forced does not run with speculative decoding")
    base = params if params is not None else SamplingParams()
    if base.prompt_logprobs is not None:
        raise ValueError("teacher_forced: prompt_logprobs would call compute_logits too")
    params = SamplingParams(
        temperature=0.0, max_tokens=n - prompt_len, ignore_eos=True,
        kv_eviction_policy=base.kv_eviction_policy, kv_budget_tokens=base.kv_budget_tokens,
        num_sink_tokens=base.num_sink_tokens)
    model = engine.runner.model
    kv = engine.scheduler.kv_cache_manager
    run = TeacherForcedRun()
    original = model.compute_logits

    def forced_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)  # [1, vocab_size]: the one request's sampled row
        if logits.shape[0] != 1:
            raise RuntimeError(f"teacher_forced: expected 1 logits row, got {logits.shape[0]}")
        k = run.num_rows
        on_logits(k, logits[0].float())
        run.num_rows += 1
        run.evicted_tokens.append(int(kv.num_evicted_tokens.get(request_id, 0)))
        run.num_kept_blocks.append(len(kv.get_block_ids(request_id)))
        forced = torch.full_like(logits, float("-inf"))
        forced[0, token_ids[prompt_len + k]] = 0.0
        return forced

    model.compute_logits = forced_logits  # instance attribute shadows the method
    try:
        engine.add_request(request_id, {"prompt_token_ids": list(token_ids[:prompt_len])},
                           params)
        out_ids: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                out_ids = list(out.outputs[0].token_ids)
    finally:
        del model.compute_logits
    if out_ids != list(token_ids[prompt_len:]):  # the forcing took hold
        raise RuntimeError("teacher_forced: the engine did not emit the forced tokens")
    return run

"""Prompt logprobs, computed in the prefill's own forward pass (vLLM v1's
``_get_prompt_logprobs_dict`` in ``gpu_model_runner.py``).

The hidden state at prompt position ``j`` predicts prompt token ``j + 1``, so a
prefill chunk over positions ``[start, end)`` yields the entries of prompt tokens
``start + 1 .. min(end, P - 1)`` (``P`` prompt tokens; the last prompt position's
logits are the first sampled token's, handled by the sampler)::

    prompt:     t0   t1   t2   t3   t4        (P = 5)
    chunk 1:   [p0   p1]                      -> entries of t1, t2
    chunk 2:             [p2   p3   p4]       -> entries of t3, t4 (p4 samples)

Entries accumulate on the request and are handed out once, with the request's first
sampled token (so a chunked prefill returns them whole). A request preempted by
recompute computes its prompt again; entries it already has are not recomputed
twice. Positions the request did not compute (a forked ``n > 1`` sibling that shares
its leader's prompt KV) leave the request without prompt logprobs (``None``), never
with wrong ones; prompt-logprob requests do not read the prefix cache (see the
scheduler), which is what keeps vLLM bug 13105 away.
"""

from __future__ import annotations

import torch

from llmserve.layers.sampler import compute_logprobs, gather_logprobs

# one prompt position's entry: (ids, logprobs, rank); ids[0] is the prompt token, then top-k
PromptLogprobEntry = tuple[list[int], list[float], int]

ROWS_PER_CHUNK = 256  # logits rows materialized at once ([256, V] float32)


def collect_prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor,
                            layout: list[tuple[object, int, int, int]]) -> None:
    """Append this step's prompt-logprob entries to each request state that asks.

    Args:
        model: has ``compute_logits(hidden [N, H]) -> [N, V]``.
        hidden: ``[num_tokens, H]``, this step's final hidden states.
        layout: per scheduled request ``(state, offset, start, num_tokens)``: its
            first row in ``hidden``, its first position, its scheduled token count.
            ``state`` has ``token_ids``, ``num_prompt_tokens``, ``sampling_params``
            and ``prompt_logprobs`` (a list, or None once unavailable).
    """
    for state, offset, start, qlen in layout:
        k = state.sampling_params.prompt_logprobs
        entries = state.prompt_logprobs
        if k is None or entries is None:
            continue
        num_prompt = state.num_prompt_tokens
        done = len(entries)  # entries of prompt tokens 1..done are known
        first = max(start, done)
        last = min(start + qlen, num_prompt - 1)  # exclusive: position P-1 samples
        if first >= last:
            continue
        if done < start:  # positions before this chunk were never computed here
            state.prompt_logprobs = None
            continue
        for lo in range(first, last, ROWS_PER_CHUNK):
            hi = min(lo + ROWS_PER_CHUNK, last)
            rows = hidden[offset + lo - start: offset + hi - start]
            logprobs = compute_logprobs(model.compute_logits(rows))  # [rows, V] float32
            targets = torch.tensor(state.token_ids[lo + 1: hi + 1], dtype=torch.long,
                                   device=logprobs.device)
            ids, lps, ranks = gather_logprobs(logprobs, k, targets)
            for i, l_, r in zip(ids.tolist(), lps.tolist(), ranks.tolist()):
                entries.append((i, l_, r))


def wants_prompt_logprobs(layout: list[tuple[object, int, int, int]]) -> bool:
    return any(s.sampling_params.prompt_logprobs is not None
               and s.prompt_logprobs is not None for s, *_ in layout)

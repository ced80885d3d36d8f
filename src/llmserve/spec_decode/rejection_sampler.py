"""Lossless verification of drafted tokens: a pure function over batched tensors.

For request ``i`` with drafts ``x_1 .. x_k`` the target model scored ``k + 1``
positions (rows): row ``j`` (0-based) is the target's next-token distribution
after ``x_1 .. x_j``. Flattened over the batch::

    request:        A (k=2)          B (k=0)   C (k=3)
    target rows:    A0 A1 A2         B0        C0 C1 C2 C3        R = sum(k_i + 1)
    draft tokens:   a1 a2                      c1 c2 c3           sum(k_i)

Greedy requests accept while the target's argmax equals the draft, then emit the
argmax at the first mismatch (or after the last draft: the bonus token), so the
output is exactly greedy decoding of the target. Sampled requests use speculative
sampling (Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding", ICML 2023, Algorithm 1; Chen et al., "Accelerating Large Language Model
Decoding with Speculative Sampling", 2023): accept ``x_j`` with probability
``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection draw from
``norm(max(0, p_j - q_j))``; when all ``k`` are accepted draw a bonus token from
``p_k``. ``p`` is the target's distribution after the request's own temperature,
min-p, top-k and top-p (penalties and min_tokens are applied to the logits by the
caller, per row); ``q`` is the draft's, built by the proposer with the same
transformations, or one-hot for a deterministic proposer (n-gram). The emitted
tokens are then distributed exactly as sampling from ``p``.

Random numbers: a seeded request draws ``k`` uniforms, then the exponential noise
of the final draw (shape ``[V]``) from its own generator, so its tokens do not
depend on the rest of the batch; a request without drafts samples exactly as
:func:`llmserve.layers.sampler.random_sample` does.
"""

from __future__ import annotations

import torch

from llmserve.layers.sampler import (
    SamplingMetadata,
    apply_min_p,
    apply_temperature,
    apply_top_k_top_p,
    random_sample,
)


def target_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """``softmax(top_k_top_p(min_p(logits / T)))`` per row: ``[R, V]`` -> ``[R, V]`` float32.

    Greedy rows (temperature 0) are divided by 1; their probabilities are unused.
    """
    logits = apply_temperature(logits.to(torch.float32), metadata.temperature)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    return torch.softmax(logits, dim=-1)


def rejection_sample(target_logits: torch.Tensor, metadata: SamplingMetadata,
                     num_draft_tokens: list[int], draft_token_ids: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> list[list[int]]:
    """Verify every request's drafts; return the tokens each request emits.

    Args:
        target_logits: ``[R, V]`` target logits, ``R = sum(k_i + 1)``, request by
            request (rows as in the module diagram), min_tokens and penalties applied.
        metadata: sampling metadata of the ``R`` rows (a request's parameters
            repeated on each of its rows); ``metadata.generators[r]`` for the first
            row ``r`` of a seeded request is that request's generator.
        num_draft_tokens: ``k_i >= 0`` per request (``B`` entries).
        draft_token_ids: ``[sum k_i]`` int64 drafts, request by request.
        draft_probs: ``[sum k_i, V]`` the draft distribution ``q`` each draft was
            sampled from, or None for deterministic drafts (``q`` one-hot).

    Returns:
        Per request, ``m_i + 1`` tokens: the ``m_i`` accepted leading drafts, then
        the recovered (first rejection) or bonus (all accepted) token.

    Raises:
        ValueError: when the shapes disagree with ``num_draft_tokens``.
    """
    device = target_logits.device
    ks = torch.tensor(num_draft_tokens, dtype=torch.int64)
    num_reqs, total_drafts = len(num_draft_tokens), int(ks.sum())
    if target_logits.shape[0] != total_drafts + num_reqs or \
            draft_token_ids.shape[0] != total_drafts:
        raise ValueError(f"rejection_sample: {target_logits.shape[0]} target rows and "
                         f"{draft_token_ids.shape[0]} drafts for num_draft_tokens="
                         f"{num_draft_tokens}")
    row_start = torch.cumsum(ks + 1, 0) - (ks + 1)  # first target row of each request
    draft_start = torch.cumsum(ks, 0) - ks
    req_of_draft = torch.repeat_interleave(torch.arange(num_reqs), ks)
    pos_of_draft = torch.arange(total_drafts) - draft_start[req_of_draft]
    draft_rows = (row_start[req_of_draft] + pos_of_draft).to(device)
    draft_ids = draft_token_ids.to(device=device, dtype=torch.int64)
    greedy_ids = None if metadata.all_random else target_logits.argmax(dim=-1)
    probs = None if metadata.all_greedy else target_probs(target_logits, metadata)
    gens = {i: metadata.generators[int(r)] for i, r in enumerate(row_start.tolist())
            if int(r) in metadata.generators}

    # accept / reject each draft
    row_greedy = metadata.temperature == 0  # [R]
    accept = torch.zeros(total_drafts, dtype=torch.bool, device=device)
    if greedy_ids is not None:
        accept = greedy_ids[draft_rows] == draft_ids
    if probs is not None and total_drafts:
        uniform = torch.rand(total_drafts, device=device)
        for i, gen in gens.items():
            k, s = num_draft_tokens[i], int(draft_start[i])
            if k:
                uniform[s:s + k] = torch.rand(k, device=device, generator=gen)
        p_x = probs[draft_rows, draft_ids]
        q_x = (torch.ones_like(p_x) if draft_probs is None
               else draft_probs.to(device)[torch.arange(total_drafts, device=device), draft_ids])
        sampled_accept = uniform * q_x < p_x
        accept = torch.where(row_greedy[draft_rows], accept, sampled_accept)
    max_k = int(ks.max()) if num_reqs else 0
    padded = torch.zeros(num_reqs, max(max_k, 1), dtype=torch.bool, device=device)
    padded[req_of_draft.to(device), pos_of_draft.to(device)] = accept
    num_accepted = padded.to(torch.int64).cumprod(dim=1).sum(dim=1).cpu()  # [B]

    # the final token: at the first rejection, or the bonus after all drafts
    final_rows = (row_start + num_accepted).to(device)
    final = torch.empty(num_reqs, dtype=torch.int64, device=device)
    if greedy_ids is not None:
        final = greedy_ids[final_rows]
    if probs is not None:
        dist = probs[final_rows].clone()  # [B, V]
        rejected = (num_accepted < ks).nonzero().flatten()
        if rejected.numel():
            at = draft_start[rejected] + num_accepted[rejected]  # the rejected draft's index
            if draft_probs is None:
                q = torch.zeros_like(dist[rejected.to(device)])
                q[torch.arange(rejected.numel(), device=device), draft_ids[at.to(device)]] = 1.0
            else:
                q = draft_probs.to(device)[at.to(device)]
            residual = (dist[rejected.to(device)] - q).clamp_min_(0.0)
            # p == q (to rounding) means "always accept": keep p for the measure-zero rest
            empty = residual.sum(dim=-1, keepdim=True) <= 0
            dist[rejected.to(device)] = torch.where(empty, dist[rejected.to(device)], residual)
        sampled = random_sample(dist, gens)
        final = sampled if greedy_ids is None else torch.where(
            row_greedy[final_rows], final, sampled)

    drafts = draft_ids.tolist()
    out: list[list[int]] = []
    for s, m, tok in zip(draft_start.tolist(), num_accepted.tolist(), final.tolist()):
        out.append(drafts[s:s + m] + [tok])
    return out

"""Token sampling as a pure function over batched per-request parameters.

The pipeline follows vLLM v1's ``Sampler`` (vllm/v1/sample/sampler.py)::

    logits [B, V] (model output)
      v
    grammar bitmask: -inf on tokens a row's structured-output grammar forbids
      |-- log_softmax ------------------------------> raw logprobs (if requested)
      v
    logit_bias (OpenAI): + bias on the listed ids of each row
    min_tokens: -inf on EOS / stop_token_ids of rows still below min_tokens
      v
    penalties: repetition (CTRL, prompt + output), frequency and presence (OpenAI, output)
      |-- argmax -----------------------------------> greedy rows
      v
    / temperature -> min_p -> top_k -> top_p -> softmax -> argmax(probs / q), q ~ Exp(1)
                                                 ----> random rows

Every step below is a function of tensors and can be checked on its own; the
only Python loop over rows draws the exponential noise of seeded rows from
their own generators (shape ``[V]``, so a seeded row's tokens do not depend on
the rest of the batch). Works on any device; nothing is moved to the CPU
except token-id lists built into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.sampling_params import SamplingParams, SamplingType


@dataclass
class SamplingMetadata:
    """Batched sampling parameters of one step; build with :func:`build_sampling_metadata`.

    ``B`` is the number of rows (requests sampled this step), ``V`` the vocab size.
    """

    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [B] float32, None when no row uses it
    top_k: torch.Tensor | None  # [B] int64 (V where disabled), None when unused
    min_p: torch.Tensor | None  # [B] float32, None when unused
    generators: dict[int, torch.Generator]  # row -> per-request generator (seeded rows)
    no_penalties: bool
    presence_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, max_prompt_len] int64 padded with V
    output_token_ids: list[list[int]]  # tokens generated so far, per row
    min_tokens: dict[int, tuple[int, set[int]]]  # row -> (min_tokens, ids blocked until reached)
    max_num_logprobs: int | None  # largest `logprobs` in the batch, None if no row asks
    # (rows, ids, biases) of rows with a logit_bias, None when no row has one
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # [R, ceil(V / 32)] int32 allowed-token bits (structured outputs) of rows
    # token_bitmask_rows ([R] int64; None: all B rows), None when unused
    token_bitmask: torch.Tensor | None = None
    token_bitmask_rows: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    """Result of one sampling step for ``B`` rows; ``N = max_num_logprobs``."""

    sampled_token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None  # [B, N + 1] int64; col 0 sampled, then top-N
    logprobs: torch.Tensor | None  # [B, N + 1] float32, matching logprob_token_ids
    sampled_token_ranks: torch.Tensor | None  # [B] int64, 1-based rank of the sampled token


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for a seeded request on ``device``; create it once, reuse it every step."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _pad_token_ids(token_ids: list[list[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    """Right-pad lists of ids with ``pad`` into a ``[B, max_len]`` int64 tensor (max_len >= 1)."""
    max_len = max((len(t) for t in token_ids), default=0)
    rows = [list(t) + [pad] * (max_len - len(t)) for t in token_ids]
    out = torch.tensor(rows, dtype=torch.int64).reshape(len(token_ids), max_len)
    if max_len == 0:
        out = torch.full((len(token_ids), 1), pad, dtype=torch.int64)
    return out.to(device, non_blocking=True)


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    eos_token_ids: set[int] | tuple,
    vocab_size: int,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """Gather per-request parameters into batched tensors on ``device``.

    Args:
        params: one validated :class:`SamplingParams` per row.
        prompt_token_ids: prompt ids per row (used only by the repetition penalty).
        output_token_ids: ids generated so far per row (kept by reference).
        generators: per row, the request's generator (from :func:`make_generator`,
            created once per request and on ``device``) or None. Required for rows
            whose params have a ``seed``; used for any random row that has one.
        eos_token_ids: the model's EOS ids; blocked with ``stop_token_ids`` while
            a row has fewer than ``min_tokens`` outputs (as vLLM, even with ignore_eos).
        vocab_size: ``V``, the width of the logits. Ids >= V are ignored.

    Raises:
        ValueError: when the list lengths differ or a seeded row has no generator.
    """
    batch = len(params)
    if not len(prompt_token_ids) == len(output_token_ids) == len(generators) == batch:
        raise ValueError(
            f"params, prompt_token_ids, output_token_ids and generators must have the same "
            f"length, got {batch}, {len(prompt_token_ids)}, {len(output_token_ids)}, {len(generators)}")
    types = [p.sampling_type for p in params]
    gens: dict[int, torch.Generator] = {}
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if types[i] == SamplingType.RANDOM_SEED and g is None:
            raise ValueError(f"row {i} has seed={p.seed} but no generator; create one with "
                             "make_generator(seed, device) when the request arrives and pass it every step")
        if g is not None and types[i] != SamplingType.GREEDY:
            gens[i] = g

    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)

    greedy = [t == SamplingType.GREEDY for t in types]
    top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    no_penalties = all(p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
                       and p.repetition_penalty == 1.0 for p in params)
    eos = {int(e) for e in eos_token_ids}
    min_tokens = {}
    for i, p in enumerate(params):
        if p.min_tokens > 0:
            blocked = {t for t in eos | set(p.stop_token_ids or ()) if 0 <= t < vocab_size}
            min_tokens[i] = (p.min_tokens, blocked)
    num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    bias_rows, bias_ids, bias_vals = [], [], []
    for i, p in enumerate(params):
        for tid, v in (p.logit_bias or {}).items():
            if 0 <= tid < vocab_size:
                bias_rows.append(i)
                bias_ids.append(tid)
                bias_vals.append(v)
    logit_bias = None
    if bias_rows:
        logit_bias = (torch.tensor(bias_rows, dtype=torch.int64).to(device),
                      torch.tensor(bias_ids, dtype=torch.int64).to(device), f32(bias_vals))
    return SamplingMetadata(
        logit_bias=logit_bias,
        temperature=f32([0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=f32([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None,
        top_k=(torch.tensor(top_k, dtype=torch.int64).to(device)
               if any(k < vocab_size for k in top_k) else None),
        min_p=f32([p.min_p for p in params]) if any(p.min_p > 0.0 for p in params) else None,
        generators=gens,
        no_penalties=no_penalties,
        presence_penalties=f32([p.presence_penalty for p in params]),
        frequency_penalties=f32([p.frequency_penalty for p in params]),
        repetition_penalties=f32([p.repetition_penalty for p in params]),
        prompt_token_ids=(None if no_penalties
                          else _pad_token_ids(prompt_token_ids, vocab_size, device)),
        output_token_ids=output_token_ids,
        min_tokens=min_tokens,
        max_num_logprobs=max(num_logprobs) if num_logprobs else None,
    )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
    """-inf where the bit of a token is 0: ``bitmask`` ``[R, ceil(V / 32)]`` int32, bit
    ``t % 32`` of word ``t // 32`` for token ``t`` (xgrammar's layout), for the rows
    ``rows`` (``[R]`` int64) of ``logits`` or all of them. New tensor; the cost is
    proportional to the constrained rows only."""
    if rows is not None:
        rows = rows.to(logits.device)
        return logits.index_copy(0, rows, apply_token_bitmask(logits.index_select(0, rows),
                                                              bitmask))
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().reshape(words.shape[0], -1)
    return logits.masked_fill(~allowed[:, :logits.shape[-1]], float("-inf"))


def apply_logit_bias(logits: torch.Tensor,
                     logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Add each row's biases to the listed ids (OpenAI ``logit_bias``). New tensor."""
    rows, ids, vals = logit_bias
    return logits.index_put((rows, ids), vals, accumulate=True)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the vocab in float32: ``[B, V]`` -> ``[B, V]``."""
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def apply_min_tokens(logits: torch.Tensor, min_tokens: dict[int, tuple[int, set[int]]],
                     output_token_ids: list[list[int]]) -> torch.Tensor:
    """Set to -inf the blocked ids of rows with fewer than ``min_tokens`` outputs (new tensor)."""
    rows: list[int] = []
    cols: list[int] = []
    for row, (count, blocked) in min_tokens.items():
        if len(output_token_ids[row]) < count:
            rows.extend([row] * len(blocked))
            cols.extend(blocked)
    if not rows:
        return logits
    index = torch.tensor([rows, cols], dtype=torch.int64).to(logits.device)
    return logits.index_put((index[0], index[1]), torch.tensor(float("-inf"), device=logits.device))


def get_token_bin_counts_and_mask(token_ids: torch.Tensor, vocab_size: int
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Count each id per row: ``[B, L]`` ids padded with ``V`` -> counts ``[B, V]`` int64, mask bool."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    ids = token_ids.clamp(0, vocab_size)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    counts = counts[:, :vocab_size]
    return counts, counts > 0


def apply_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor | None,
                    output_token_ids: list[list[int]], presence_penalties: torch.Tensor,
                    frequency_penalties: torch.Tensor, repetition_penalties: torch.Tensor
                    ) -> torch.Tensor:
    """Apply repetition, then frequency and presence penalties (new ``[B, V]`` tensor).

    Repetition (CTRL, Keskar et al. 2019; as HF and vLLM): for ids in the prompt
    or output, ``logit / p`` when the logit is > 0, else ``logit * p``. Frequency
    and presence (OpenAI API reference, "Parameter details"):
    ``logit -= frequency * count + presence * (count > 0)`` over output ids.

    Args:
        logits: ``[B, V]`` float32.
        prompt_token_ids: ``[B, P]`` int64 padded with ``V``, or None (no prompt).
        output_token_ids: generated ids per row.
        presence_penalties, frequency_penalties, repetition_penalties: ``[B]`` float32.
    """
    vocab_size = logits.shape[-1]
    output_ids = _pad_token_ids(output_token_ids, vocab_size, logits.device)
    output_counts, output_mask = get_token_bin_counts_and_mask(output_ids, vocab_size)
    seen = output_mask
    if prompt_token_ids is not None:
        seen = seen | get_token_bin_counts_and_mask(prompt_token_ids, vocab_size)[1]
    penalty = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - frequency_penalties.unsqueeze(1) * output_counts
    return logits - presence_penalties.unsqueeze(1) * output_mask


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature ``[B]``; rows with temperature 0 (greedy) by 1."""
    temperature = torch.where(temperature > 0, temperature, 1.0)
    return logits / temperature.unsqueeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf tokens with ``prob < min_p * max_prob`` (min_p ``[B]``; 0 keeps all)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits, then its top-``top_p`` nucleus (new tensor).

    top_k ``[B]`` int64 in [1, V] (V keeps all; ties with the k-th logit are kept);
    top_p ``[B]`` float32 in (0, 1]: drop the least likely tokens whose cumulative
    probability is <= 1 - top_p, always keeping the most likely one (Holtzman et
    al. 2019, "The Curious Case of Neural Text Degeneration"; same rule as vLLM and HF).
    """
    if top_k is None and top_p is None:
        return logits
    if top_p is None:  # top-k alone: no full sort needed
        top_values = logits.topk(int(top_k.max()), dim=-1).values
        kth = top_values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth, float("-inf"))
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = logits_sort.gather(1, (logits.shape[-1] - top_k).unsqueeze(1))
        logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
    cum_probs = logits_sort.softmax(dim=-1).cumsum(dim=-1)
    remove = cum_probs <= 1 - top_p.unsqueeze(1)
    remove[:, -1] = False
    logits_sort = logits_sort.masked_fill(remove, float("-inf"))
    return logits_sort.scatter(1, logits_idx, logits_sort)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row by the exponential race: ``argmax(probs / q)``, ``q ~ Exp(1)``.

    Equivalent to sampling from ``probs`` (Gumbel-max in probability space).
    Rows in ``generators`` draw ``q`` of shape ``[V]`` from their own generator;
    the others share one draw from the default generator. ``[B, V]`` -> ``[B]`` int64.
    """
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    q.clamp_min_(torch.finfo(q.dtype).tiny)  # q == 0 would give 0/0 = nan on filtered tokens
    return (probs / q).argmax(dim=-1)


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Greedy rows: argmax of ``logits``; random rows: temperature, filters, random draw. -> [B]."""
    greedy = None if metadata.all_random else logits.argmax(dim=-1)
    if metadata.all_greedy:
        return greedy
    logits = apply_temperature(logits, metadata.temperature)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    sampled = random_sample(torch.softmax(logits, dim=-1), metadata.generators)
    if greedy is None:
        return sampled
    return torch.where(metadata.temperature == 0, greedy, sampled)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the sampled tokens and of each row's top-``num_logprobs``.

    Args:
        logprobs: ``[B, V]`` float32 log-probabilities.
        num_logprobs: ``N >= 0``.
        token_ids: ``[B]`` int64 sampled ids.

    Returns:
        ids ``[B, N + 1]`` int64 (column 0 the sampled token, then the top-N by
        logprob, descending), their logprobs ``[B, N + 1]`` float32, and the
        1-based rank ``[B]`` int64 of the sampled token (number of tokens whose
        logprob is >= its own, as vLLM).
    """
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    token_ids = token_ids.unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    return (torch.cat([token_ids, top_ids], dim=1), torch.cat([token_logprobs, top_logprobs], dim=1),
            ranks)


class Sampler(torch.nn.Module):
    """Turn a step's logits into sampled tokens (and logprobs), as vLLM v1's ``Sampler``."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[B, V]`` model output (converted to float32; not modified).
            metadata: from :func:`build_sampling_metadata` for the same rows.

        Returns:
            :class:`SamplerOutput`; the logprob fields are None unless some row
            asked for logprobs. Logprobs come from the logits after the grammar mask
            (as vLLM), before logit_bias, min_tokens, penalties, temperature and
            filtering.
        """
        logits = logits.to(torch.float32)
        if metadata.token_bitmask is not None:
            logits = apply_token_bitmask(logits, metadata.token_bitmask,
                                         metadata.token_bitmask_rows)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = compute_logprobs(logits)
        if metadata.logit_bias is not None:
            logits = apply_logit_bias(logits, metadata.logit_bias)
        logits = apply_min_tokens(logits, metadata.min_tokens, metadata.output_token_ids)
        if not metadata.no_penalties:
            logits = apply_penalties(
                logits, metadata.prompt_token_ids, metadata.output_token_ids,
                metadata.presence_penalties, metadata.frequency_penalties,
                metadata.repetition_penalties)
        sampled = sample(logits, metadata)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        ids, logprobs, ranks = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled, ids, logprobs, ranks)

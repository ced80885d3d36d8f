"""KV cache quality: perplexity, KL divergence and top-1 agreement of a quantized KV
cache or an eviction policy against the full-precision, full-KV run (issue 15 item 5).

Every variant runs the same text teacher-forced through the engine
(:mod:`llmserve.engine.teacher_forcing`) on one set of weights: the reference with KV
pages in the model's dtype (float32 by default) and no eviction, each variant with its
``kv_cache_dtype`` or its policy and budget. Row ``k`` of a run predicts token
``P + k`` of the text (``P`` = ``prompt_len``); rows ``k >= 1`` are decode steps::

    NLL_k      = -log p_k(t_{P+k})                  p = variant, P_ = reference
    KL_k       = sum_v P_k(v) (log P_k(v) - log p_k(v))       (nats)
    perplexity = exp(mean NLL_k),  top-1 = share of rows with argmax P_k == argmax p_k

over the scored rows: ``k >= 1`` (decode steps) and, for an eviction policy, ``k >=``
the first row computed after the request's first eviction, so every scored token is
predicted from the evicted cache. With ``prompt_len`` above the budget the prompt is
evicted at the first decode step (the prompt itself runs as one full-attention chunk, as
kvpress's presses compress after prefill). The reference's perplexity is over the same
rows (``reference_perplexity``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from llmserve.engine.teacher_forcing import teacher_forced


@dataclass(frozen=True)
class KVVariant:
    """One KV setting: ``kv_cache_dtype`` (``auto`` = the model's dtype), or an eviction
    ``policy`` with ``budget_tokens`` (per sequence) and ``num_sink_tokens``."""

    kv_cache_dtype: str = "auto"
    policy: str = "none"
    budget_tokens: int | None = None
    num_sink_tokens: int = 4
    kv_key_quant: str = "per-token"  # per-channel: int8 keys per block and channel

    @property
    def name(self) -> str:
        if self.policy != "none":
            return f"{self.policy}@{self.budget_tokens}"
        if self.kv_key_quant == "per-channel":
            return f"kv-{self.kv_cache_dtype}-per-channel-keys"
        return "full" if self.kv_cache_dtype == "auto" else f"kv-{self.kv_cache_dtype}"

    @property
    def cache_key(self) -> str:
        """The engine this variant runs on (build_engines)."""
        if self.kv_key_quant == "per-channel":
            return f"{self.kv_cache_dtype}/per-channel"
        return self.kv_cache_dtype


@dataclass
class KVQualityResult:
    """A variant's metrics over ``num_tokens`` scored rows starting at ``first_row``;
    ``max_kept_blocks``: the most KV blocks the request held in a scored row."""

    variant: str
    kv_cache_dtype: str
    policy: str
    budget_tokens: int | None
    num_tokens: int
    first_row: int
    perplexity: float
    reference_perplexity: float
    kl_mean: float
    kl_max: float
    top1_agreement: float
    max_kept_blocks: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_engines(model: str | None, kv_cache_dtypes: list[str], num_tokens: int,
                  dtype: str = "float32", quantization: str = "none",
                  block_size: int = 16) -> dict[str, Any]:
    """``{kv_cache_dtype: LLMEngine}`` on one set of weights (``"auto"`` always present),
    each with a pool for one ``num_tokens``-token sequence and one prefill chunk of up to
    ``num_tokens`` tokens, prefix caching off.

    Raises:
        ValueError: a bad model, dtype, quantization or KV dtype.
    """
    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.engine.llm_engine import LLMEngine

    blocks = -(-num_tokens // block_size) + 2
    first = LLMEngine.from_engine_args(EngineArgs(
        model=model, dtype=dtype, quantization=quantization, enable_prefix_caching=False,
        max_num_seqs=1, max_model_len=num_tokens + block_size,
        max_num_batched_tokens=max(num_tokens + block_size, 2048), block_size=block_size,
        num_gpu_blocks_override=blocks))
    return {"auto": first, **kv_dtype_variants(first, kv_cache_dtypes)}


def kv_dtype_variants(first, kv_cache_dtypes: list[str]) -> dict[str, Any]:
    """``{kv_cache_dtype: LLMEngine}``: engines on ``first``'s weights, tokenizer and
    settings that differ only in the KV cache dtype (each its own fresh pool); a dtype
    equal to ``first``'s configured one is skipped."""
    from llmserve.engine.llm_engine import LLMEngine

    cfg = first.config
    engines = {}
    for kv in kv_cache_dtypes:  # "int8/per-channel": int8 pages, per-channel keys
        if kv in engines or kv == cfg.cache_config.kv_cache_dtype:
            continue
        dt, _, key_quant = kv.partition("/")
        variant = dataclasses.replace(
            cfg, cache_config=dataclasses.replace(cfg.cache_config, kv_cache_dtype=dt,
                                                  kv_key_quant=key_quant or "per-token"))
        engines[kv] = LLMEngine(variant, first.tokenizer, first.runner.model)
    return engines


def _params(v: KVVariant):
    from llmserve.sampling_params import SamplingParams

    return SamplingParams(kv_eviction_policy=v.policy,
                          kv_budget_tokens=v.budget_tokens if v.policy != "none" else None,
                          num_sink_tokens=v.num_sink_tokens)


def reference_logprobs(engine, token_ids: list[int], prompt_len: int) -> torch.Tensor:
    """The reference run's log-probabilities ``[N - P, vocab_size]`` float32."""
    rows: list[torch.Tensor] = []
    teacher_forced(engine, token_ids, prompt_len,
                   lambda k, logits: rows.append(torch.log_softmax(logits.double(), -1).float()))
    return torch.stack(rows)


def score_variant(engine, token_ids: list[int], prompt_len: int, variant: KVVariant,
                  ref_logprobs: torch.Tensor) -> KVQualityResult:
    """Run ``variant`` teacher-forced on ``engine`` and score it against
    ``ref_logprobs`` (from :func:`reference_logprobs` on the same tokens).

    Raises:
        ValueError: the variant's settings are refused by the engine, or no row is
            left to score (an eviction that never happens: text shorter than the budget).
    """
    import time

    targets = token_ids[prompt_len:]
    nll, kl, agree = [], [], []

    def on_logits(k: int, logits: torch.Tensor) -> None:
        logp = torch.log_softmax(logits.double(), -1)
        ref = ref_logprobs[k].double()
        nll.append(-float(logp[targets[k]]))
        kl.append(max(0.0, float((ref.exp() * (ref - logp)).sum())))
        agree.append(int(ref.argmax()) == int(logp.argmax()))

    t0 = time.perf_counter()
    run = teacher_forced(engine, token_ids, prompt_len, on_logits, _params(variant),
                         request_id=f"kvq-{variant.name}")
    seconds = time.perf_counter() - t0
    first = 1
    if variant.policy != "none":
        evicted = run.first_evicted_row()
        if evicted is None:
            raise ValueError(f"{variant.name}: nothing was evicted ({len(token_ids)} tokens "
                             f"within a {variant.budget_tokens}-token budget)")
        first = max(first, evicted)
    if first >= run.num_rows:
        raise ValueError(f"{variant.name}: no row left to score")
    rows = range(first, run.num_rows)
    ref_nll = [-float(ref_logprobs[k, targets[k]]) for k in rows]
    count = len(rows)
    return KVQualityResult(
        variant=variant.name, kv_cache_dtype=variant.kv_cache_dtype, policy=variant.policy,
        budget_tokens=variant.budget_tokens if variant.policy != "none" else None,
        num_tokens=count, first_row=first,
        perplexity=math.exp(sum(nll[k] for k in rows) / count),
        reference_perplexity=math.exp(sum(ref_nll) / count),
        kl_mean=sum(kl[k] for k in rows) / count, kl_max=max(kl[k] for k in rows),
        top1_agreement=sum(agree[k] for k in rows) / count,
        max_kept_blocks=max(run.num_kept_blocks[k] for k in rows), seconds=round(seconds, 1))


def evaluate_kv(model: str | None, text: str, variants: list[KVVariant],
                num_tokens: int = 2048, prompt_len: int | None = None,
                dtype: str = "float32", quantization: str = "none",
                progress=None) -> list[KVQualityResult]:
    """``llmserve eval --kv-cache-dtype/--kv-eviction-policy``: the first ``num_tokens``
    tokens of ``text`` (BOS first when the tokenizer has one), the first ``prompt_len``
    (default ``num_tokens // 2``) as the prompt; one result per variant, in order.
    ``progress(result)`` is called after each variant.

    Raises:
        ValueError: too short a text, a bad split, model or variant.
    """
    from llmserve.tokenizer import encode_text

    kv_dtypes = sorted({v.cache_key for v in variants} | {"auto"})
    engines = build_engines(model, kv_dtypes, num_tokens, dtype, quantization)
    tok = engines["auto"].tokenizer
    ids = encode_text(tok, text, "text", add_special_tokens=False)
    if tok.bos_token_id is not None:
        ids = [tok.bos_token_id, *ids]
    if len(ids) < num_tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than --num-tokens "
                         f"{num_tokens}")
    ids = ids[:num_tokens]
    prompt_len = prompt_len if prompt_len is not None else num_tokens // 2
    if not 1 <= prompt_len < num_tokens - 1:
        raise ValueError(f"--prompt-tokens must be in [1, {num_tokens - 2}], got {prompt_len}")
    ref = reference_logprobs(engines["auto"], ids, prompt_len)
    results = []
    for v in variants:
        r = score_variant(engines[v.cache_key], ids, prompt_len, v, ref)
        results.append(r)
        if progress is not None:
            progress(r)
    return results

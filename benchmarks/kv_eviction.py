"""Needle in a haystack under a KV budget: recall per eviction policy (issue 15).

A fact ("The secret passcode is NNNNN.") is planted at depths 10..90% of a filler
text of ``--context`` tokens; the question at the end asks for it; a sample counts as
recalled when the greedy answer (``--max-tokens``) contains the number. Each policy
runs with ``--budget`` tokens of KV per sequence (``none``: the full KV, the ceiling).
The prompt is computed in one chunk (``max_num_batched_tokens`` >= context), so every
policy compresses after a full-attention prefill, as kvpress's presses do.

``--samples`` needles (secrets drawn with ``--seed``) per depth; recall per policy and
per depth. The JSON records each case's depth, secret and the sha256 of its prompt's
token ids, so ``benchmarks/kv_eviction_kvpress.py`` (kvpress's presses on transformers,
in a separate venv: kvpress pins transformers < 5.3) runs the same texts and checks it.

Usage::

    PYTHONPATH=src nice -n 10 python benchmarks/kv_eviction.py --context 8192 \
        --budget 1024 --depths 10,30,50,70,90 --samples 3 \
        --json docs/benchmarks/kv_eviction_8k.json
    PYTHONPATH=src python benchmarks/kv_eviction.py --context 2048 --budget 256 \
        --depths 10,50,90 --policies none,streaming_llm,snapkv
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")


def build_prompt(tokenizer, context: int, depth: float, secret: str) -> str:
    """Filler up to about ``context`` tokens with the needle at ``depth`` (0..1)."""
    needle = f" The secret passcode is {secret}. "
    question = ("\n\nWhat is the secret passcode mentioned in the text above? "
                "Answer with the number only. The secret passcode is")
    per = len(tokenizer.encode(FILLER))
    budget = context - len(tokenizer.encode(needle + question)) - 8
    n = max(1, budget // per)
    k = int(n * depth)
    return FILLER * k + needle + FILLER * (n - k) + question


def make_cases(depths: list[float], samples: int, seed: int) -> list[tuple[float, str]]:
    """``samples`` (depth, secret) cases per depth, secrets from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [(d, str(rng.randrange(10000, 99999))) for d in depths for _ in range(samples)]


def ids_sha256(ids: list[int]) -> str:
    """sha256 of the token ids as comma-separated decimals (compared across scripts)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def per_depth(cases: list[tuple[float, str]], hits: list[bool]) -> dict[str, float]:
    """``{"10": recall, ...}``: the share of hits per depth (percent keys)."""
    out: dict[str, list[bool]] = {}
    for (d, _), h in zip(cases, hits, strict=True):
        out.setdefault(str(round(d * 100)), []).append(h)
    return {k: sum(v) / len(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--depths", default="10,20,30,40,50,60,70,80,90")
    ap.add_argument("--policies", default="none,streaming_llm,h2o,snapkv")
    ap.add_argument("--samples", type=int, default=1, help="needles per depth")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    from llmserve import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=args.context, enable_prefix_caching=False,
              max_num_batched_tokens=args.context, block_size=16)
    from llmserve.tokenizer import encode_text

    tok = llm.engine.tokenizer
    depths = [int(d) / 100 for d in args.depths.split(",")]
    cases = make_cases(depths, args.samples, args.seed)
    prompts = [encode_text(tok, build_prompt(tok, args.context, d, s)) for d, s in cases]

    def dump() -> None:  # rewritten after every policy
        if not args.json:
            return
        with open(args.json, "w") as f:
            json.dump({"engine": "llmserve", "context": args.context, "budget": args.budget,
                       "depths": depths, "samples": args.samples, "seed": args.seed,
                       "max_tokens": args.max_tokens,
                       "cases": [{"depth": d, "secret": s, "num_tokens": len(ids),
                                  "ids_sha256": ids_sha256(ids)}
                                 for (d, s), ids in zip(cases, prompts, strict=True)],
                       "results": results}, f, indent=1)

    results = {}
    for policy in args.policies.split(","):
        hits, t0 = [], time.perf_counter()
        answers = []
        for (_, secret), ids in zip(cases, prompts, strict=True):
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                    kv_eviction_policy=policy,
                                    kv_budget_tokens=None if policy == "none" else args.budget)
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            answers.append(out.outputs[0].text)
            hits.append(secret in answers[-1])
        results[policy] = {"recall": sum(hits) / len(hits), "per_depth": per_depth(cases, hits),
                           "hits": hits, "answers": answers,
                           "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{policy:14s} recall {results[policy]['recall']:.2f} "
              f"{''.join('x' if h else '.' for h in hits)}  ({results[policy]['seconds']} s)",
              flush=True)
        dump()


if __name__ == "__main__":
    main()

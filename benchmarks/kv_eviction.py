"""Needle in a haystack under a KV budget: recall per eviction policy (issue 15).

A fact ("The secret passcode is NNNNN.") is planted at depths 10..90% of a filler
text of ``--context`` tokens; the question at the end asks for it; a sample counts as
recalled when the greedy answer (``--max-tokens``) contains the number. Each policy
runs with ``--budget`` tokens of KV per sequence (``none``: the full KV, the ceiling).
The prompt is computed in one chunk (``max_num_batched_tokens`` >= context), so every
policy compresses after a full-attention prefill, as kvpress's presses do.

kvpress itself is not run beside it here: its wheels pin transformers < 5.3 and this
project's environment has 5.24 (installing kvpress would downgrade it), so its
numbers are not reported from this script.

Usage::

    PYTHONPATH=src python benchmarks/kv_eviction.py --context 8192 --budget 1024
    PYTHONPATH=src python benchmarks/kv_eviction.py --context 2048 --budget 256 \
        --depths 10,50,90 --policies none,streaming_llm,snapkv
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--depths", default="10,20,30,40,50,60,70,80,90")
    ap.add_argument("--policies", default="none,streaming_llm,h2o,snapkv")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    from llmserve import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=args.context + 64, enable_prefix_caching=False,
              max_num_batched_tokens=args.context + 64, block_size=16)
    tok = llm.engine.tokenizer
    rng = random.Random(args.seed)
    depths = [int(d) / 100 for d in args.depths.split(",")]
    cases = [(d, str(rng.randrange(10000, 99999))) for d in depths]
    results = {}
    for policy in args.policies.split(","):
        hits, t0 = [], time.perf_counter()
        for depth, secret in cases:
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                    kv_eviction_policy=policy,
                                    kv_budget_tokens=None if policy == "none" else args.budget)
            out = llm.generate([build_prompt(tok, args.context, depth, secret)], params,
                               use_tqdm=False)[0]
            hits.append(secret in out.outputs[0].text)
        results[policy] = {"recall": sum(hits) / len(hits), "hits": hits,
                           "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{policy:14s} recall {results[policy]['recall']:.2f} "
              f"{''.join('x' if h else '.' for h in hits)}  ({results[policy]['seconds']} s)",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": args.context, "budget": args.budget, "depths": depths,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

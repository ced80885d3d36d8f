"""Does one structured-output request slow the others in its batch?

Offline engine, default model (float32). The same 8 plain requests (ignore_eos,
``--tokens`` each) run batched with 1 or 4 extra sampled requests, once unconstrained
(the control: same batch size) and once constrained by a hard JSON schema (nested
object, enum, patterns, arrays). The grammar is compiled
before the run (the server compiles in a worker thread before admitting a request),
so what is measured is the per-step mask cost: decode tokens/s of the plain requests,
and the median step time.

    PYTHONPATH=src python benchmarks/structured_output_overhead.py [--tokens 32] [--reps 3]
        [--no-jump-forward]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")

from grammar_libs import SCHEMA  # noqa: E402
from llmserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402


def run(llm: LLM, num_plain: int, num_structured: int, tokens: int,
        constrained: bool = True) -> tuple[float, float]:
    eng = llm.engine
    plain = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    so = StructuredOutputsParams(json=SCHEMA)
    eng.structured_output.compile(so)  # as the server does, before admission
    for i in range(num_plain):
        eng.add_request(f"p{i}", f"Story number {i}: once upon a time", plain)
    for i in range(num_structured):
        eng.add_request(f"s{i}", "A user record as JSON:", SamplingParams(
            temperature=0.8, seed=i, max_tokens=tokens * 4, ignore_eos=not constrained,
            structured_outputs=so if constrained else None))
    steps, done, t0 = [], {}, time.perf_counter()
    while any(f"p{i}" not in done for i in range(num_plain)):
        s0 = time.perf_counter()
        for out in eng.step():
            if out.finished:
                done[out.request_id] = time.perf_counter()
        steps.append(time.perf_counter() - s0)
    elapsed = max(done[f"p{i}"] for i in range(num_plain)) - t0
    eng.abort_request([f"s{i}" for i in range(num_structured)])
    while eng.has_unfinished_requests():
        eng.step()
    return num_plain * tokens / elapsed, statistics.median(steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-jump-forward", action="store_true",
                    help="decode grammar-forced tokens one step each")
    args = ap.parse_args()
    llm = LLM(dtype="float32", kv_cache_memory="256MiB", jump_forward=not args.no_jump_forward)
    run(llm, 8, 1, 4)  # warm-up (and the tokenizer table of the grammar compiler)
    print(f"{'batch':<34} {'plain tok/s':>12} {'median step ms':>15}")
    for num_extra in (1, 4):
        res = {}
        for constrained in (False, True):
            runs = [run(llm, 8, num_extra, args.tokens, constrained) for _ in range(args.reps)]
            res[constrained] = (statistics.median(r[0] for r in runs),
                                statistics.median(r[1] for r in runs))
            kind = "JSON-schema" if constrained else "unconstrained"
            print(f"8 plain + {num_extra} {kind:<22} {res[constrained][0]:12.1f} "
                  f"{res[constrained][1] * 1e3:15.1f}")
        print(f"   -> plain tokens/s with {num_extra} constrained vs unconstrained: "
              f"{res[True][0] / res[False][0]:.3f}x")


if __name__ == "__main__":
    main()

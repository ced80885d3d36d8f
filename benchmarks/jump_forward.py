"""Jump-forward decoding of grammar-forced tokens: on vs off (``--no-jump-forward``).

Default model, default format (bfloat16, gguf-hybrid). Structured requests (a JSON
schema with long keys and an enum, so much of the output is forced; and the nested
schema of grammar_libs.py) run alone and 8 at once, greedy, with jump-forward on and
off in one interleaved run (the order alternates per repetition). Reported per
setting: output tokens/s (end to end) and engine steps per output token and request
(below 1: the grammar forced the rest); and llama.cpp's grammar-constrained decoding of
the forced schema at batch 1 (``LlamaGrammar.from_json_schema``; llama.cpp has no
jump-forward) side by side.

    .venv/bin/python benchmarks/jump_forward.py [--reps 3] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from tests.test_jump_forward import SCHEMA as FORCED  # noqa: E402

from grammar_libs import SCHEMA as NESTED  # noqa: E402
from llmserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

PROMPTS = ["A customer record as JSON:", "Another customer, as JSON:", "JSON for a user:",
           "One record, JSON only:", "The next customer as JSON:", "A JSON user account:",
           "Customer data (JSON):", "Here is the JSON record:"]


def run(llm: LLM, schema: dict, batch: int) -> dict:
    eng = llm.engine
    so = StructuredOutputsParams(json=schema)
    eng.structured_output.compile(so)  # as the server does, before admission
    for i in range(batch):
        eng.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(
            temperature=0.0, max_tokens=160, structured_outputs=so))
    steps, done, t0 = 0, {}, time.perf_counter()
    while eng.has_unfinished_requests():
        steps += 1
        done.update({o.request_id: o for o in eng.step() if o.finished})
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in done.values())
    valid = all(json.loads(o.outputs[0].text) is not None for o in done.values()
                if o.outputs[0].finish_reason == "stop")
    return {"tokens_per_s": tokens / elapsed, "tokens": tokens, "steps": steps,
            "valid_json": valid}


def llama_cpp_rate(schema: dict, prompt: str) -> float | None:
    try:
        from llama_cpp import Llama, LlamaGrammar
    except ImportError as e:
        print(f"llama.cpp skipped: {e}", file=sys.stderr)
        return None
    from llmserve.loader import resolve_model

    llm = Llama(model_path=resolve_model(None).path, n_ctx=1024, n_threads=2, verbose=False)
    grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
    llm.create_completion(prompt, max_tokens=4, temperature=0.0)  # warm-up
    t0 = time.perf_counter()
    r = llm.create_completion(prompt, max_tokens=160, temperature=0.0, grammar=grammar)
    return r["usage"]["completion_tokens"] / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-llama-cpp", action="store_true")
    args = ap.parse_args()
    on = LLM(kv_cache_memory="256MiB")
    off = LLM(kv_cache_memory="256MiB", jump_forward=False)
    engines = {"on": on, "off": off}
    schemas = {"forced": FORCED, "nested": NESTED}
    for llm in engines.values():  # warm-up
        run(llm, FORCED, 1)
    results: dict[tuple, list[dict]] = {}
    for rep in range(args.reps):
        for schema_name, schema in schemas.items():
            for batch in (1, 8):
                names = ["on", "off"] if rep % 2 == 0 else ["off", "on"]
                for name in names:
                    r = run(engines[name], schema, batch)
                    results.setdefault((schema_name, batch, name), []).append(r)
                    print(f"rep {rep} {schema_name:6} batch {batch} {name:3} "
                          f"{r['tokens_per_s']:7.1f} tok/s  {r['steps']} steps", file=sys.stderr)
    print("| schema | batch | jump-forward | output tok/s | steps / output token | vs off |")
    print("|---|---|---|---|---|---|")
    for schema_name in schemas:
        for batch in (1, 8):
            med = {n: statistics.median(r["tokens_per_s"] for r in results[(schema_name, batch, n)])
                   for n in ("on", "off")}
            for name in ("on", "off"):
                r0 = results[(schema_name, batch, name)][0]
                print(f"| {schema_name} | {batch} | {name} | {med[name]:.1f} | "
                      f"{r0['steps'] / r0['tokens'] * batch:.2f} | "
                      f"{med[name] / med['off']:.2f}x |")
    if not args.no_llama_cpp:  # the forced schema only: llama-cpp-python 0.3's grammar
        # converter cannot parse the nested schema's pattern (\.) and then segfaults
        rate = llama_cpp_rate(FORCED, PROMPTS[0])
        if rate is not None:
            print(f"| forced | 1 | llama.cpp (grammar) | {rate:.1f} | 1.00 | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

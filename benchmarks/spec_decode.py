"""Speculative decoding on Qwen2.5-Coder-1.5B-Instruct (issue 14): no speculation vs
n-gram prompt lookup vs the Qwen2.5-Coder-0.5B-Instruct draft (scoring the whole
vocabulary, or only ids below ``--draft-vocab-size``), fixed k and adaptive k, at several batch sizes, interleaved in one run; llama.cpp's prompt-lookup mode
(``llama-cpp-python``'s ``LlamaPromptLookupDecoding``) side by side at batch 1.

Prompt sets (greedy, EOS ignored, the same prompts for every method):

    code  write-a-function requests (code completion: the draft agrees often)
    edit  "rewrite this code" with the code in the prompt (the output copies the
          input: n-gram lookup finds it)

Batch B is one closed batch of B requests (cycling through the set; batch 1: every
prompt of the set, one after another). ``--waves N`` runs N x B requests instead, kept
B in flight as a client with B connections would (a finished request is replaced at
once). A closed batch shrinks as its fastest requests end, so it times the slowest
one; with waves, requests end at different steps and their replacements prefill
alone, each in its own fixed 64-row prompt GEMMs (gguf-hybrid's batch invariance),
which costs an engine whose requests run at different speeds more than one whose
requests all end together (measured at batch 4 with 3 waves: n-gram adaptive
0.91-0.96x, against 0.97-0.99x closed).

Every engine shares the target's (and the draft's) loaded weights and has its own
KV cache; prefix caching is off so every run prefills alike. Each repetition runs
every (batch size, prompt set) on every method, rotating the method order, so drift
on a shared machine hits all alike. Reported: output tokens/s (end to end: prefill
included) and decode tokens/s (batch size / TPOT, TPOT = (E2E - TTFT) / (tokens - 1): the
issue's "decode tokens/s", without the prefill both share), each with its ratio to no speculation, acceptance rate and mean acceptance length,
and whether the greedy tokens equal those without speculation.

    .venv/bin/python benchmarks/spec_decode.py                    # batch 1, 4
    .venv/bin/python benchmarks/spec_decode.py --batch-sizes 1,4,16,64 --new-tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time

from llmserve import LLM, SamplingParams
from llmserve.engine.llm_engine import LLMEngine
from llmserve.loader.pypi_models import fetch_model
from llmserve.spec_decode import SpeculativeConfig
from llmserve.spec_decode.draft_model import load_draft_model

CODE = [
    "Write a Python function `is_prime(n)` that returns True if n is a prime number.",
    "Write a Python function that reverses a singly linked list, with a Node class.",
    "Write a Python function `merge_sorted(a, b)` that merges two sorted lists.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods.",
]
SNIPPET = '''def computeTotal(itemList, taxRate):
    runningTotal = 0
    for currentItem in itemList:
        itemPrice = currentItem["price"]
        itemCount = currentItem["count"]
        runningTotal = runningTotal + itemPrice * itemCount
    taxAmount = runningTotal * taxRate
    finalTotal = runningTotal + taxAmount
    return finalTotal
'''
EDIT = [
    "Rewrite this code with snake_case variable names. Output only the code.\n\n" + SNIPPET,
    "Add type hints to this function. Output only the code.\n\n" + SNIPPET,
    "Add a docstring to this function and keep everything else. Output only the code.\n\n"
    + SNIPPET,
    "Rename `computeTotal` to `compute_total` in this code. Output only the code.\n\n"
    + SNIPPET,
]


def chatml(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def build_engines(args) -> dict[str, LLM]:
    base = LLM(model=args.target, kv_cache_memory=args.kv_cache_memory,
               enable_prefix_caching=False, max_model_len=args.max_model_len)
    engines = {"off": base}
    model, tok = base.engine.runner.model, base.engine.tokenizer
    k = args.k
    specs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 3},
        "draft": {"method": "draft_model", "model": args.draft, "num_speculative_tokens": k},
        "draftvocab": {"method": "draft_model", "model": args.draft,
                       "num_speculative_tokens": k, "draft_vocab_size": args.draft_vocab_size},
    }
    drafts: dict[str, object] = {}  # one loaded draft per method
    for method in args.methods:
        for policy in args.policies:
            sc = SpeculativeConfig.from_value({**specs[method], "draft_length_policy": policy})
            cfg = dataclasses.replace(base.engine.config, speculative_config=sc)
            if method != "ngram" and method not in drafts:
                drafts[method] = load_draft_model(cfg, tok)
            engines[f"{method}-{policy}"] = LLM.from_engine(LLMEngine(
                cfg, tok, model, draft_model=drafts.get(method)))
    return engines


def workload(prompts: list[str], bs: int, waves: int) -> list[str]:
    """The requests of one run at concurrency ``bs``: every prompt of the set once at
    batch 1; else ``waves * bs`` requests cycling through the set (``waves`` 1: one
    closed batch of ``bs``)."""
    n = len(prompts) if bs == 1 else waves * bs
    return [prompts[i % len(prompts)] for i in range(n)]


_IDS = itertools.count()


def run_concurrent(llm: LLM, prompts: list[str], bs: int, sp: SamplingParams) -> list:
    """Generate for ``prompts`` keeping ``bs`` requests in flight (a client with ``bs``
    connections: a finished request is replaced at once), so a batch stays ``bs`` until
    the last wave instead of shrinking as its fastest requests end. Outputs in order."""
    engine, queue, live, outs = llm.engine, list(enumerate(prompts)), {}, {}
    while queue or engine.has_unfinished_requests():
        while queue and len(live) < bs:
            i, prompt = queue.pop(0)
            live[engine.add_request(f"bench-{next(_IDS)}", prompt, sp)] = i
        for out in engine.step():
            if out.finished:
                outs[live.pop(out.request_id)] = out
    return [outs[i] for i in range(len(prompts))]


def run_once(llm: LLM, prompts: list[str], bs: int, new_tokens: int) -> dict:
    stats = llm.engine.spec_decoding_stats
    before = stats.as_dict() if stats else None
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = run_concurrent(llm, prompts, bs, sp)
    elapsed = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    # decode tokens/s: bs / TPOT, TPOT = (E2E - TTFT) / (tokens - 1) weighted by tokens
    decode_s = sum(o.metrics.finished_time - o.metrics.first_token_time for o in outs)
    res = {"tokens_per_s": n / elapsed, "tokens": [o.outputs[0].token_ids for o in outs],
           "decode_tokens_per_s": bs * (n - len(outs)) / decode_s}
    if stats:
        after = stats.as_dict()
        drafts = after["num_drafts"] - before["num_drafts"]
        drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        res["acceptance_rate"] = accepted / drafted if drafted else 0.0
        res["mean_acceptance_length"] = 1 + accepted / drafts if drafts else 1.0
    return res


def run_llama_cpp(args, prompts: list[str]) -> dict:
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        print(f"llama.cpp skipped: {e}", file=sys.stderr)
        return {}
    out = {}
    for name, draft in (("llama.cpp off", None),
                        ("llama.cpp ngram", LlamaPromptLookupDecoding(num_pred_tokens=args.k,
                                                                      max_ngram_size=3))):
        llm = Llama(model_path=args.target, n_ctx=args.max_model_len, n_threads=args.threads,
                    verbose=False, draft_model=draft, seed=0)
        llm.create_completion(prompts[0], max_tokens=4, temperature=0.0)  # warm-up
        tokens = seconds = decode_tokens = decode_seconds = 0
        for p in prompts[:args.llama_cpp_prompts]:
            t0 = time.perf_counter()
            stamps = [time.perf_counter() for _ in llm.create_completion(
                p, max_tokens=args.new_tokens, temperature=0.0, stream=True)]  # a chunk a token
            tokens, seconds = tokens + len(stamps), seconds + stamps[-1] - t0
            decode_tokens += len(stamps) - 1
            decode_seconds += stamps[-1] - stamps[0]
        out[name] = (tokens / seconds, decode_tokens / decode_seconds)
        del llm
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target GGUF (default: the 1.5B, fetched)")
    ap.add_argument("--draft", default=None, help="draft GGUF (default: the 0.5B, fetched)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--waves", type=int, default=1,
                    help="requests per run = waves x batch size, kept `batch size` in flight "
                    "(1: one closed batch; batch 1 always runs each prompt once)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--methods", default="ngram,draft,draftvocab",
                    help="ngram, draft (the full vocabulary), draftvocab (the draft scores "
                    "ids below --draft-vocab-size)")
    ap.add_argument("--draft-vocab-size", type=int, default=32768)
    ap.add_argument("--policies", default="fixed,adaptive")
    ap.add_argument("--sets", default="code,edit")
    ap.add_argument("--kv-cache-memory", default="768MiB")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--llama-cpp-prompts", type=int, default=4,
                    help="prompts of each set llama.cpp runs (batch 1, one at a time)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    args.target = args.target or fetch_model("qwen2.5-coder-1.5b-instruct-q4_k_m")
    args.draft = args.draft or fetch_model("qwen2.5-coder-0.5b-instruct")
    args.methods = args.methods.split(",")
    args.policies = args.policies.split(",")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    sets = {"code": [chatml(p) for p in CODE], "edit": [chatml(p) for p in EDIT]}
    sets = {s: sets[s] for s in args.sets.split(",")}

    engines = build_engines(args)
    for llm in engines.values():  # warm-up: kernels, allocator
        llm.generate(sets[next(iter(sets))][:1], SamplingParams(max_tokens=4), use_tqdm=False)
    results: dict[tuple, list[dict]] = {}
    names = list(engines)
    for rep in range(args.reps):
        for bs in batch_sizes:
            for set_name, prompts in sets.items():
                batch = workload(prompts, bs, args.waves)
                order = names[rep % len(names):] + names[:rep % len(names)]
                for name in order:
                    r = run_once(engines[name], batch, bs, args.new_tokens)
                    results.setdefault((bs, set_name, name), []).append(r)
                    print(f"rep {rep} bs {bs} {set_name:4} {name:15} "
                          f"{r['tokens_per_s']:7.2f} tok/s", file=sys.stderr, flush=True)
    rows = []
    print(f"\ntarget {args.target}\ndraft {args.draft}\nk={args.k}, {args.new_tokens} new "
          f"tokens, greedy, dtype {engines['off'].engine.config.dtype}, {args.reps} rep(s)\n")
    print("| batch | prompts | method | tokens/s | vs off | decode tok/s | vs off | "
          "acceptance | mean acc. len | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for bs in batch_sizes:
        for set_name in sets:
            base = results[(bs, set_name, "off")]
            off = statistics.median(r["tokens_per_s"] for r in base)
            off_dec = statistics.median(r["decode_tokens_per_s"] for r in base)
            ref = base[0]["tokens"]
            for name in names:
                rs = results[(bs, set_name, name)]
                tps = statistics.median(r["tokens_per_s"] for r in rs)
                dec = statistics.median(r["decode_tokens_per_s"] for r in rs)
                acc = rs[0].get("acceptance_rate")
                mal = rs[0].get("mean_acceptance_length")
                same = all(r["tokens"] == ref for r in rs)
                rows.append(dict(batch=bs, prompts=set_name, method=name, tokens_per_s=tps,
                                 speedup=tps / off, decode_tokens_per_s=dec,
                                 decode_speedup=dec / off_dec, acceptance_rate=acc,
                                 mean_acceptance_length=mal, same_tokens=same))
                print(f"| {bs} | {set_name} | {name} | {tps:.2f} | {tps / off:.2f}x | "
                      f"{dec:.2f} | {dec / off_dec:.2f}x | "
                      f"{'-' if acc is None else f'{acc:.2f}'} | "
                      f"{'-' if mal is None else f'{mal:.2f}'} | {same} |")
    peers = {}
    if not args.no_llama_cpp and 1 in batch_sizes:
        for set_name, prompts in sets.items():
            for name, (tps, dec) in run_llama_cpp(args, prompts).items():
                peers[f"{name} {set_name}"] = {"tokens_per_s": tps, "decode_tokens_per_s": dec}
                print(f"| 1 | {set_name} | {name} | {tps:.2f} | | {dec:.2f} | | | | |")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "llama_cpp": peers, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

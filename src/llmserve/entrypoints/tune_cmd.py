"""``llmserve tune``: pick ``max_num_batched_tokens`` and the KV cache size for a
stated goal from measured step times, cache the result per model and machine, and
write down why. ``llmserve up`` runs it for worker settings that say ``auto``.

Probe (one engine, prefix caching off, random prompt ids so nothing is cached):

- for each candidate token budget ``T``: the time of one engine step that prefills a
  ``T``-token prompt (median of ``--repeats``); a chunked-prefill step of budget
  ``T`` costs about that, and every running request's next token waits for it;
- one decode step with ``max_num_seqs`` (capped at 32) sequences running.

Choice of the token budget (Sarathi-Serve, Agrawal et al., OSDI 2024: the budget
trades prefill throughput against the decode stall it causes):

- ``latency``: the largest ``T`` whose step time stays within the time-between-tokens
  SLO (``--tbt-slo-ms``, default 100 ms); the smallest candidate if none does;
- ``throughput``: the smallest ``T`` whose prefill throughput ``T / step(T)`` is within
  10% of the best measured (larger budgets gain little and stall decodes longer).

KV cache: enough for ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped at
half the memory still available after the weights loaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import time

DEFAULT_BUDGETS = (256, 512, 1024, 2048, 4096)


def pick_budget(step_s: dict[int, float], goal: str, tbt_slo_s: float) -> tuple[int, str]:
    """``(budget, why)`` from measured ``{budget: step seconds}`` (pure)."""
    budgets = sorted(step_s)
    if goal == "latency":
        ok = [b for b in budgets if step_s[b] <= tbt_slo_s]
        if not ok:
            b = budgets[0]
            return b, (f"latency: no budget keeps a step within the {tbt_slo_s * 1e3:.0f} ms "
                       f"TBT SLO; the smallest, {b} tokens, takes {step_s[b] * 1e3:.1f} ms")
        b = ok[-1]
        return b, (f"latency: {b} tokens is the largest budget whose step "
                   f"({step_s[b] * 1e3:.1f} ms) stays within the {tbt_slo_s * 1e3:.0f} ms "
                   "TBT SLO")
    if goal != "throughput":
        raise ValueError(f"goal must be latency or throughput, got {goal!r}")
    rate = {b: b / step_s[b] for b in budgets}
    best = max(rate.values())
    b = next(b for b in budgets if rate[b] >= 0.9 * best)
    return b, (f"throughput: {b} tokens reaches {rate[b]:.0f} prefill tokens/s, within 10% "
               f"of the best measured {best:.0f} tokens/s; larger budgets only stall "
               f"decodes longer (step {step_s[b] * 1e3:.1f} ms)")


def pick_kv_memory(kv_bytes_per_token: int, max_num_seqs: int, max_model_len: int,
                   available_bytes: int, block_size: int = 16) -> tuple[int, str]:
    """``(bytes, why)``: all sequences at full length, capped at half of what is free."""
    need = max_num_seqs * -(-max_model_len // block_size) * block_size * kv_bytes_per_token
    cap = available_bytes // 2
    floor = 64 * block_size * kv_bytes_per_token  # at least 64 blocks
    chosen = max(min(need, cap), floor)
    why = (f"{max_num_seqs} sequences x {max_model_len} tokens x {kv_bytes_per_token} B/token "
           f"= {need / 2**20:.0f} MiB")
    if need > cap:
        why += (f", more than half of the {available_bytes / 2**30:.1f} GiB available after "
                f"the weights loaded: capped at {cap / 2**20:.0f} MiB "
                f"({cap // (block_size * kv_bytes_per_token)} blocks)")
    return chosen, why


def register(subparsers) -> None:
    from llmserve.engine.arg_utils import EngineArgs

    p = subparsers.add_parser(
        "tune", help="pick the token budget and KV cache size from measured step times",
        description="Measure step times on this machine and pick max_num_batched_tokens "
                    "and kv_cache_memory for a goal; cached per model and machine.")
    p.add_argument("--goal", choices=["latency", "throughput"], default="throughput")
    p.add_argument("--tbt-slo-ms", type=float, default=100.0,
                   help="latency goal: time between tokens a step may stall (default 100)")
    p.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)),
                   help="candidate token budgets, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="steps per candidate (median)")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache",
                                                       "llmserve", "tune"))
    p.add_argument("--no-cache", action="store_true", help="measure even if cached")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_tune)


def _cache_key(args, budgets: list[int]) -> str:
    from llmserve.loader.source import resolve_model

    src = resolve_model(args.model)
    st = os.stat(src.path)
    ident = [src.path, st.st_size, int(st.st_mtime), args.dtype, args.quantization,
             args.max_num_seqs, args.max_model_len, args.block_size, args.goal,
             args.tbt_slo_ms, budgets, platform.machine(), platform.processor(),
             os.cpu_count(), os.environ.get("OMP_NUM_THREADS")]
    return hashlib.sha256(json.dumps(ident, default=str).encode()).hexdigest()[:20]


def measure(args, budgets: list[int]) -> dict:
    import psutil

    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.sampling_params import SamplingParams

    ea = EngineArgs.from_cli_args(args)
    ea.enable_prefix_caching = False
    ea.max_num_batched_tokens = max(budgets)
    ea.kv_cache_memory = ea.kv_cache_memory or "256MiB"
    engine = LLMEngine.from_engine_args(ea)
    available = psutil.virtual_memory().available
    vocab = engine.config.model_config.vocab_size
    import random

    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    limit = min(engine.max_model_len, engine.max_kv_tokens) - 2
    step_s: dict[int, float] = {}
    for b in budgets:
        if b > limit:
            continue
        times = []
        for r in range(args.repeats + 1):  # the first run warms up
            ids = [rng.randrange(10, vocab - 10) for _ in range(b)]
            engine.add_request(f"p{b}-{r}", {"prompt_token_ids": ids}, one)
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            while engine.has_unfinished_requests():
                engine.step()
        step_s[b] = statistics.median(times[1:])
    batch = max(1, min(args.max_num_seqs, 32, engine.max_kv_tokens // 64))
    for i in range(batch):
        engine.add_request(f"d{i}", {"prompt_token_ids": [rng.randrange(10, vocab - 10)
                                                          for _ in range(8)]},
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    decode = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        decode.append(time.perf_counter() - t0)
    return {"step_s": step_s, "decode_step_s": statistics.median(decode[2:] or decode),
            "decode_batch": batch, "kv_bytes_per_token": engine.kv_bytes_per_token,
            "available_bytes": available, "max_model_len": engine.max_model_len}


def run_tune(args: argparse.Namespace) -> int:
    budgets = sorted({int(b) for b in args.budgets.split(",") if b.strip()})
    if not budgets or budgets[0] <= 0:
        raise ValueError(f"--budgets must be positive integers, got {args.budgets!r}")
    key = _cache_key(args, budgets)
    path = os.path.join(args.cache_dir, key + ".json")
    result = None
    if not args.no_cache and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            result = {**json.load(f), "cached": True}
    if result is None:
        m = measure(args, budgets)
        if not m["step_s"]:
            raise ValueError("no candidate budget fits the KV cache; pass smaller --budgets")
        budget, why_b = pick_budget(m["step_s"], args.goal, args.tbt_slo_ms / 1e3)
        kv, why_kv = pick_kv_memory(m["kv_bytes_per_token"], args.max_num_seqs,
                                    m["max_model_len"], m["available_bytes"],
                                    args.block_size)
        result = {"goal": args.goal, "max_num_batched_tokens": budget, "kv_cache_memory": kv,
                  "why": {"max_num_batched_tokens": why_b, "kv_cache_memory": why_kv},
                  "measured": {**m, "step_s": {str(k): v for k, v in m["step_s"].items()}},
                  "measured_at": time.time(), "cached": False}
        os.makedirs(args.cache_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"max_num_batched_tokens: {result['max_num_batched_tokens']}  "
              f"# {result['why']['max_num_batched_tokens']}")
        print(f"kv_cache_memory: {result['kv_cache_memory']}  "
              f"# {result['why']['kv_cache_memory']}")
        for b, s in result["measured"]["step_s"].items():
            print(f"  step({b} tokens) = {s * 1e3:.1f} ms")
        print(f"  decode step ({result['measured']['decode_batch']} seqs) = "
              f"{result['measured']['decode_step_s'] * 1e3:.1f} ms"
              f"{'  (cached)' if result['cached'] else ''}")
    return 0

"""Pipeline parallelism on this machine: step time at pp=1 vs pp=2 and the bubble.

One process holds a pp=1 engine and a pp=N engine (N - 1 spawned stage ranks). The
pp=N engine runs the same batch with 1, 2, 4 micro-batches allowed in flight
(``engine.batch_queue.max_in_flight``); rounds are interleaved (pp=1, pp=N x1, x2,
x4, pp=1, ...) so drift on a shared box hits them alike; medians are reported.

*Step time* is the wall time of one round divided by the engine steps that ran a
model step (for pp=N: micro-batches submitted), *tokens/s* the generated tokens over
the round's wall time. The token budget splits the running requests into
micro-batches: with ``--batch 4 --max-num-batched-tokens 2`` each batch carries two
decodes (or a two-token prefill chunk), so with k in flight up to k such batches are
in the pipe at once; with one in flight the same batches run one after the other.
pp=1 runs with the per-stage thread count (1 here): at 2 threads on this
oversubscribed box OpenMP barrier waits made it ~10x slower, not a fair baseline.

The bubble: with one batch in flight each stage idles while the other runs, so a
step costs the sum of the stages (plus the hand-offs); with >= N in flight the
stages overlap and the round time falls towards max(stage) per step — on a machine
with a core per stage. Here the ranks share 2 cores (and other users' jobs), so
the overlap can only fill cores the other stage leaves idle; report it as measured.

    python benchmarks/pipeline_parallel.py                 # default model, pp=2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _round(llm, prompts, params) -> tuple[float, int, int]:
    """(seconds, generated tokens, model steps) of one batch."""
    steps0 = llm.engine.scheduler.stats.num_steps_total
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    steps = llm.engine.scheduler.stats.num_steps_total - steps0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs), max(steps, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2,
                    help="token budget per micro-batch (2: two decodes per batch)")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--in-flight", default="1,2,4")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    import torch

    from llmserve import LLM, SamplingParams

    kw = dict(dtype=args.dtype, kv_cache_memory="64MiB", max_model_len=512,
              max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens)
    prompts = [f"Write a short story about a robot named R{i}." for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    single = LLM(**kw)
    pipe = LLM(pipeline_parallel_size=args.pp, **kw)  # each rank: threads // pp
    pp_threads = torch.get_num_threads()
    threads = pp_threads  # pp=1 at the per-stage thread count (see the module docstring)
    depths = [int(x) for x in args.in_flight.split(",")]
    for llm in (single, pipe):  # warm-up
        _round(llm, prompts[:2], SamplingParams(temperature=0, max_tokens=2))
    samples: dict[str, list] = {"pp1": [], **{f"pp{args.pp}_inflight{d}": [] for d in depths}}
    for _ in range(args.rounds):
        torch.set_num_threads(threads)
        samples["pp1"].append(_round(single, prompts, params))
        torch.set_num_threads(pp_threads)
        for d in depths:
            pipe.engine.batch_queue.max_in_flight = d
            samples[f"pp{args.pp}_inflight{d}"].append(_round(pipe, prompts, params))
        print("round:", {k: [round(x, 3) for x in v[-1]] for k, v in samples.items()},
              file=sys.stderr, flush=True)
    report = {"model": "smollm2-135m-instruct", "dtype": args.dtype, "pp": args.pp,
              "threads": {"pp1": threads, "per_stage": pp_threads},
              "load_average": [round(x, 1) for x in os.getloadavg()],
              "batch": args.batch, "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_depth_seen": pipe.engine.batch_queue.max_depth,
              "output_len": args.output_len, "rounds": args.rounds}
    for name, rows in samples.items():
        report[name] = {
            "round_s": round(statistics.median(s for s, _, _ in rows), 3),
            "step_time_ms": round(statistics.median(s / n * 1e3 for s, _, n in rows), 2),
            "tokens_per_s": round(statistics.median(t / s for s, t, _ in rows), 2)}
    base = report[f"pp{args.pp}_inflight1"]["round_s"]
    for d in depths:
        report[f"pp{args.pp}_inflight{d}"]["round_time_vs_inflight1"] = round(
            report[f"pp{args.pp}_inflight{d}"]["round_s"] / base, 3)
    report[f"pp{args.pp}_inflight1_step_time_vs_pp1"] = round(
        report[f"pp{args.pp}_inflight1"]["step_time_ms"] / report["pp1"]["step_time_ms"], 2)
    print(json.dumps(report, indent=2))
    pipe.engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tensor parallelism on this machine: step time and tokens/s at tp=1 vs tp=N.

Both engines are loaded in one process (tp=N spawns its N-1 worker ranks) and run
the same batch in interleaved rounds (tp=1, tp=N, tp=1, ...), so drift on a shared
machine hits both alike; the report gives medians and the tp=N / tp=1 ratio. It also
reports the driver's time to broadcast one SchedulerOutput (pickle over gloo).

On a CPU box TP does not speed anything up: the ranks share the same cores and memory
bandwidth, and every layer adds two all-reduces (plus a logits all-gather per step)
over loopback TCP. Expect a ratio above 1. Examples::

    python benchmarks/tensor_parallel.py                       # default model, tp=3
    python benchmarks/tensor_parallel.py --model qwen2.5-coder-0.5b-instruct --tp 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _round(llm, prompts, params) -> tuple[float, int, int]:
    """(seconds, generated tokens, engine steps) of one batch."""
    steps0 = llm.engine.scheduler.stats.num_steps_total
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs), \
        llm.engine.scheduler.stats.num_steps_total - steps0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--tp", type=int, default=3, help="the tensor-parallel size to compare")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()

    from llmserve import LLM, SamplingParams
    from llmserve.loader.pypi_models import fetch_model

    model = args.model
    if model is not None and model.startswith("qwen2.5-coder"):
        model = fetch_model(model)
    kw = dict(model=model, dtype=args.dtype, quantization=args.quantization,
              kv_cache_memory="128MiB", max_model_len=1024)
    prompts = [f"Write a short story about a robot named R{i}." for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    import torch

    full_threads = torch.get_num_threads()
    single = LLM(**kw)
    engines = {"tp1": single, "tp1_1thread": single,
               f"tp{args.tp}": LLM(tensor_parallel_size=args.tp, **kw)}
    # tp=1 runs with all the threads and with one; the tp driver with its share (as its
    # workers): on a loaded box, OpenMP threads that wait at barriers distort tp1
    threads = {"tp1": full_threads, "tp1_1thread": 1, f"tp{args.tp}": torch.get_num_threads()}
    for llm in engines.values():  # warm-up
        _round(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=2))
    samples: dict[str, list[tuple[float, int, int]]] = {tp: [] for tp in engines}
    for _ in range(args.rounds):
        for tp, llm in engines.items():
            torch.set_num_threads(threads[tp])
            samples[tp].append(_round(llm, prompts, params))
    runner = engines[f"tp{args.tp}"].engine.runner
    report = {"model": model or "smollm2-135m-instruct", "dtype": args.dtype,
              "threads": threads, "load_average": [round(x, 1) for x in __import__("os").getloadavg()],
              "batch": args.batch, "output_len": args.output_len, "rounds": args.rounds}
    for tp, rows in samples.items():
        report[tp] = {
            "step_time_ms": round(statistics.median(s / n * 1e3 for s, _, n in rows), 2),
            "tokens_per_s": round(statistics.median(t / s for s, t, _ in rows), 2)}
    for base in ("tp1", "tp1_1thread"):
        report[f"step_time_ratio_vs_{base}"] = round(
            report[f"tp{args.tp}"]["step_time_ms"] / report[base]["step_time_ms"], 2)
    report["broadcast_ms_per_step"] = round(runner.broadcast_s / max(runner.num_broadcasts, 1)
                                            * 1e3, 3)
    print(json.dumps(report, indent=2))
    engines[f"tp{args.tp}"].engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

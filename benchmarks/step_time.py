"""Where a decode step's time goes: the model vs everything around it, and long context.

For the default model (gguf-hybrid, bfloat16, 2 threads) it measures pure decode steps:

    batch 1 and batch 64 (200-token prompts): ms per step, split into
        model   = forward + LM head (ModelRunner: model.forward, model.compute_logits)
        outside = the rest of LLMEngine.step: scheduling, input tensors, attention
                  metadata, sampling, detokenizing, outputs
    batch 1 at 2K and 8K tokens of context: ms per step

once with the C kernels of ``llmserve.kernels`` and once with the layers' PyTorch ops
(``LLMSERVE_CPU_KERNELS=0``, a subprocess), and writes ``docs/benchmarks/step_time.json``.

    .venv/bin/python benchmarks/step_time.py            # ~3 min on 2 cores
    .venv/bin/python benchmarks/step_time.py --quick    # smaller, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StepTimer:
    """Wraps an engine's runner to time its model calls inside each ``step``."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.model_s = 0.0
        self.batch = 0
        model = engine.runner.model
        for name in ("forward", "compute_logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.model_s += time.perf_counter() - t
        return call

    def decode_steps(self, prompts: list[list[int]], num_steps: int) -> list[tuple[float, float]]:
        """Prefill ``prompts`` (untimed), then time ``num_steps`` pure decode steps:
        ``[(step_s, model_s), ...]``."""
        from llmserve.sampling_params import SamplingParams

        # enough tokens that no request ends during the timed steps (the first ones
        # decode while the last prompts are still prefilling); aborted afterwards
        params = SamplingParams(max_tokens=num_steps + 256, temperature=0.0, ignore_eos=True)
        req_ids = [f"r{self.batch}-{i}" for i in range(len(prompts))]
        self.batch += 1
        for req_id, ids in zip(req_ids, prompts):
            self.engine.add_request(req_id, {"prompt_token_ids": ids}, params)
        sched = self.engine.scheduler
        # prefill until every request has its first token (then each step is all decodes)
        while any(r.num_computed_tokens < r.num_prompt_tokens
                  for r in list(sched.running) + list(sched.waiting)):
            self.engine.step()
        times = []
        for _ in range(num_steps):
            self.model_s = 0.0
            t = time.perf_counter()
            self.engine.step()
            times.append((time.perf_counter() - t, self.model_s))
            assert len(sched.running) == len(prompts), "a request ended or was preempted"
        self.engine.abort_request(req_ids)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return times


def summarize(times: list[tuple[float, float]]) -> dict:
    steps = [s for s, _ in times]
    outside = [s - m for s, m in times]
    return {"step_ms": round(statistics.median(steps) * 1e3, 3),
            "model_ms": round(statistics.median([m for _, m in times]) * 1e3, 3),
            "outside_ms": round(statistics.median(outside) * 1e3, 3),
            "steps": len(times)}


def measure(quick: bool) -> dict:
    import torch

    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.kernels import get_cpu_kernels

    torch.set_num_threads(2)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    engine = LLMEngine.from_engine_args(EngineArgs(
        dtype="bfloat16", quantization="gguf-hybrid", enable_prefix_caching=False,
        max_num_seqs=64))
    timer = StepTimer(engine)
    n = 8 if quick else 32
    out = {"kernels": get_cpu_kernels() is not None,
           "batch_1": summarize(timer.decode_steps([prompt(200)], n)),
           "batch_64": summarize(timer.decode_steps([prompt(200) for _ in range(64)],
                                                    4 if quick else 16))}
    for ctx in ((2048,) if quick else (2048, 8000)):
        out[f"context_{ctx}"] = summarize(timer.decode_steps([prompt(ctx)], n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--output", default=os.path.join(ROOT, "docs", "benchmarks",
                                                     "step_time.json"))
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "benchmarks.md"),
                    help="markdown file whose step-time section is replaced ('' = none)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.quick)))
        return
    results = {}
    for mode, env in (("c-kernels", {}), ("torch-ops", {"LLMSERVE_CPU_KERNELS": "0"})):
        cmd = [sys.executable, os.path.abspath(__file__), "--child"] + \
            (["--quick"] if args.quick else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True,
                              env={**os.environ, **env})
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [k for k in results["c-kernels"] if k != "kernels"]
    print(f"{'workload':14s} {'mode':10s} {'step ms':>9s} {'model ms':>9s} {'outside ms':>11s}")
    for row in rows:
        for mode in results:
            r = results[mode][row]
            print(f"{row:14s} {mode:10s} {r['step_ms']:9.2f} {r['model_ms']:9.2f} "
                  f"{r['outside_ms']:11.2f}")
    speedup = {row: round(results["torch-ops"][row]["step_ms"]
                          / results["c-kernels"][row]["step_ms"], 2) for row in rows}
    print("step time torch-ops / c-kernels:", speedup)
    results["speedup"] = speedup
    results["quick"] = args.quick
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    print("wrote", args.output)
    if args.doc and not args.quick:
        write_doc(args.doc, results, rows)


BEGIN, END = "<!-- step-time:begin -->", "<!-- step-time:end -->"
LABELS = {"batch_1": "batch 1, 200-token prompt", "batch_64": "batch 64, 200-token prompts",
          "context_2048": "batch 1, 2,048 tokens of context",
          "context_8000": "batch 1, 8,000 tokens of context"}


def write_doc(path: str, results: dict, rows: list[str]) -> None:
    """Replace the table between the step-time markers of ``path``."""
    lines = ["| decode step | C kernels: step / model / outside ms | PyTorch ops: step / "
             "model / outside ms | speed-up |", "|---|---|---|---|"]
    for row in rows:
        cells = []
        for mode in ("c-kernels", "torch-ops"):
            r = results[mode][row]
            cells.append(f"{r['step_ms']:.2f} / {r['model_ms']:.2f} / {r['outside_ms']:.2f}")
        lines.append(f"| {LABELS.get(row, row)} | {cells[0]} | {cells[1]} | "
                     f"{results['speedup'][row]:.2f}x |")
    lines.append("")
    lines.append(f"Medians over the timed steps; 'model' = forward + LM head, 'outside' = the "
                 f"rest of `LLMEngine.step` (scheduling, inputs, sampling, detokenizing). "
                 f"Command: `python benchmarks/step_time.py` "
                 f"({time.strftime('%Y-%m-%d %H:%M')}).")
    with open(path) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        print(f"no step-time markers in {path}; not updated")
        return
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)
    print("updated", path)


if __name__ == "__main__":
    main()

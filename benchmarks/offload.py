"""What CPU offload and the layer split cost: bytes moved per step and step time.

Variants of one model (the default one unless ``--model``), measured interleaved
(round r runs every variant once, so a drifting machine shifts all of them alike):

    whole       every layer and its weights on the device (the baseline)
    offload-K   --cpu-offload-gb sized for K layers: their weights cross host -> device
                every forward pass (synchronous memcpy on the CPU; pinned copies on a side
                stream, prefetching the next layer, on CUDA)
    split-N     --num-device-layers N: layers N.. and their KV on the CPU; the hidden
                state crosses once per step

For each: pure decode steps at batch 1 and batch 8 (32-token prompts), median ms per
step, the weight bytes streamed per forward pass, and the copy bandwidth the extra time
implies (``bytes / (step - whole step)``). On a CPU-only machine "device" and host are the
same memory, so this measures the mechanism's cost (an extra memcpy of the offloaded
bytes per step), not PCIe; run with ``--device cuda`` on a GPU machine for the real case.
Writes ``docs/benchmarks/offload.json``.

    .venv/bin/python benchmarks/offload.py              # ~2 min on 2 quiet cores
    .venv/bin/python benchmarks/offload.py --quick
    .venv/bin/python benchmarks/offload.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def decode_step_ms(engine, prompts: list[list[int]], num_steps: int, tag: str) -> float:
    """Median ms of ``num_steps`` pure decode steps of ``prompts`` (prefill untimed)."""
    from llmserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=num_steps + 64, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for req_id, p in zip(ids, prompts):
        engine.add_request(req_id, {"prompt_token_ids": p}, params)
    sched = engine.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in list(sched.running) + list(sched.waiting)):
        engine.step()
    engine.step()  # one untimed decode
    times = []
    for _ in range(num_steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def measure(args: argparse.Namespace) -> dict:
    import torch

    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.worker.offload import layer_tensors, tensors_bytes

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    base_kw = dict(model=args.model, dtype=args.dtype, device=args.device,
                   kv_cache_memory="256MiB", enable_prefix_caching=False, max_num_seqs=16)
    whole = LLMEngine.from_engine_args(EngineArgs(**base_kw))
    layers = whole.runner.model.model.layers
    num_layers = len(layers)
    layer_bytes = tensors_bytes(layer_tensors(layers[0]))
    engines = {"whole": whole}
    for k in (num_layers // 3, num_layers):
        gb = (k + 0.5) * layer_bytes / 1024**3
        engines[f"offload-{k}"] = LLMEngine.from_engine_args(EngineArgs(
            cpu_offload_gb=gb, **base_kw))
    split = num_layers // 2
    engines[f"split-{split}"] = LLMEngine.from_engine_args(EngineArgs(
        num_device_layers=split, **base_kw))
    rng = random.Random(0)
    prompts = {b: [[rng.randrange(1000, 40000) for _ in range(32)] for _ in range(b)]
               for b in (1, 8)}
    steps = 4 if args.quick else 16
    results: dict[str, dict[int, list[float]]] = {n: {1: [], 8: []} for n in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            for b, ps in prompts.items():
                results[name][b].append(decode_step_ms(engine, ps, steps, f"{name}-{r}-{b}"))
    out = {"model": whole.config.model, "device": args.device, "dtype": whole.config.dtype,
           "threads": torch.get_num_threads(), "rounds": args.rounds, "steps": steps,
           "num_layers": num_layers, "layer_bytes": layer_bytes, "variants": {}}
    base = {b: statistics.median(results["whole"][b]) for b in (1, 8)}
    for name, engine in engines.items():
        stats = getattr(engine.runner.model, "offload_stats", None)
        moved = stats.bytes_per_forward if stats else 0
        row = {"offloaded_layers": stats.num_layers if stats else 0,
               "bytes_per_forward": moved,
               "staging_bytes": stats.staging_bytes if stats else 0}
        for b in (1, 8):
            ms = statistics.median(results[name][b])
            extra = ms - base[b]
            row[f"batch_{b}"] = {
                "step_ms": round(ms, 3), "vs_whole": round(ms / base[b], 3),
                "extra_ms": round(extra, 3),
                "implied_GBps": round(moved / (extra * 1e-3) / 1e9, 2)
                if moved and extra > 0 else None}
        out["variants"][name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", default=os.path.join(ROOT, "docs", "benchmarks",
                                                         "offload.json"))
    args = parser.parse_args()
    if args.quick:
        args.rounds = min(args.rounds, 2)
    out = measure(args)
    print(json.dumps(out, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()

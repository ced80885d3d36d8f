"""Offline benchmarks on the ``LLM`` engine: throughput and latency.

``run_throughput``: every request submitted at once, timed to the last output
(vLLM ``benchmark_throughput``): requests/s, output tokens/s, total tokens/s.

``run_latency``: a fixed batch of ``batch_size`` prompts of ``input_len`` tokens,
``output_len`` new tokens each (EOS ignored), stepped by hand so each engine
step is timed::

    step:   1 (prefill, maybe chunked) ...  k (last first token)  k+1 ... (decode)
    TTFT  = first token time - arrival, per request
    decode step time = wall time of each step after every request has its first token
    batch latency = arrival to the last token of the batch (vLLM's "latency")
"""

from __future__ import annotations

import random
import time

import numpy as np

from llmserve.benchmarks.datasets import SampleRequest
from llmserve.engine.output_processor import RequestOutputKind
from llmserve.sampling_params import SamplingParams

PERCENTILES = (50, 90, 99)


def _dist_ms(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds if seconds else [0.0], dtype=np.float64) * 1000.0
    out = {"mean": float(ms.mean()), "median": float(np.median(ms))}
    out.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


def run_throughput(llm, requests: list[SampleRequest], ignore_eos: bool = False,
                   temperature: float = 1.0, seed: int = 0, use_tqdm: bool = True) -> dict:
    """Generate for all ``requests`` in one batch; returns counts and rates.

    Keys: ``elapsed_time`` (s), ``num_requests``, ``total_input_tokens``,
    ``total_output_tokens``, ``total_num_tokens``, ``requests_per_second``,
    ``output_tokens_per_second``, ``tokens_per_second`` (input + output).
    """
    params = [SamplingParams(temperature=temperature, top_p=1.0, max_tokens=r.expected_output_len,
                             ignore_eos=ignore_eos, seed=seed + i)
              for i, r in enumerate(requests)]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_time": elapsed, "num_requests": len(outs), "total_input_tokens": n_in,
            "total_output_tokens": n_out, "total_num_tokens": n_in + n_out,
            "requests_per_second": len(outs) / elapsed,
            "output_tokens_per_second": n_out / elapsed,
            "tokens_per_second": (n_in + n_out) / elapsed}


def _one_batch(engine, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params,
                              RequestOutputKind.DELTA) for i, p in enumerate(prompts)]
    t_start = time.perf_counter()
    pending_first = set(ids)
    step_times: list[float] = []
    decode_steps: list[float] = []
    ttfts: dict[str, float] = {}
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        step_times.append(t1 - t0)
        decoding = not pending_first
        for out in outs:
            if out.request_id in pending_first and out.outputs[0].token_ids:
                pending_first.discard(out.request_id)
                ttfts[out.request_id] = t1 - t_start
        if decoding:
            decode_steps.append(t1 - t0)
    return {"latency": time.perf_counter() - t_start, "ttfts": list(ttfts.values()),
            "step_times": step_times, "decode_steps": decode_steps}


def run_latency(llm, batch_size: int, input_len: int, output_len: int, num_iters: int = 3,
                num_iters_warmup: int = 1, seed: int = 0) -> dict:
    """Time ``num_iters`` batches (after ``num_iters_warmup``); all times in ms.

    Returns keys ``batch_latency_ms``, ``ttft_ms``, ``decode_step_ms`` (each a
    dict of mean/median/p50/p90/p99), ``decode_tokens_per_second`` (batch_size /
    median decode step), and the settings.

    Raises:
        ValueError: non-positive sizes, or a batch the engine cannot hold.
    """
    for name, v in (("batch_size", batch_size), ("input_len", input_len),
                    ("output_len", output_len), ("num_iters", num_iters)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    engine = llm.engine
    vocab = engine.config.model_config.vocab_size
    rng = random.Random(seed)
    lo, hi = (1000, vocab - 1000) if vocab > 4000 else (0, vocab - 1)
    prompts = [[rng.randint(lo, hi) for _ in range(input_len)] for _ in range(batch_size)]
    runs = [_one_batch(engine, prompts, output_len, f"lat{i}")
            for i in range(num_iters_warmup + num_iters)][num_iters_warmup:]
    decode = [t for r in runs for t in r["decode_steps"]]
    median_step = float(np.median(decode)) if decode else float("nan")
    return {"batch_size": batch_size, "input_len": input_len, "output_len": output_len,
            "num_iters": num_iters,
            "batch_latency_ms": _dist_ms([r["latency"] for r in runs]),
            "ttft_ms": _dist_ms([t for r in runs for t in r["ttfts"]]),
            "decode_step_ms": _dist_ms(decode),
            "steps_per_batch": float(np.mean([len(r["step_times"]) for r in runs])),
            "decode_tokens_per_second": batch_size / median_step if decode else 0.0}

"""``llmserve bench {throughput,latency,serve}``: vLLM-style benchmarks.

::

    llmserve bench throughput --dataset-name random --random-input-len 256 \\
        --random-output-len 128 --num-prompts 64 --ignore-eos [--output-json out.json]
    llmserve bench latency --batch-size 8 --input-len 32 --output-len 128
    llmserve bench serve --base-url http://127.0.0.1:8000 --endpoint /v1/completions \\
        --request-rate 4 --max-concurrency 16 --num-prompts 200 --goodput ttft:500 tpot:50

Engine flags (``--dtype``, ``--quantization``, ...) apply to throughput and latency.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time

from llmserve.entrypoints.arg_types import positive_int


def _write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    print(f"saved {path}", file=sys.stderr)


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests/s or 'inf', got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text!r}")
    return v


def _report_spec_decoding(llm, res: dict) -> None:
    """Acceptance rate and mean acceptance length when speculation is on."""
    stats = llm.engine.spec_decoding_stats
    if stats is None:
        return
    res["spec_decoding"] = stats.as_dict()
    print(stats.log_line())


# ---------------------------------------------------------------- throughput / latency
def _run_throughput(args) -> int:
    from llmserve.benchmarks.datasets import load_requests
    from llmserve.benchmarks.engine import weight_format_of
    from llmserve.benchmarks.offline import run_throughput
    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.engine.llm import LLM
    from llmserve.engine.llm_engine import LLMEngine

    llm = LLM.from_engine(LLMEngine.from_engine_args(EngineArgs.from_cli_args(args)))
    requests = load_requests(args, llm.get_tokenizer())
    res = run_throughput(llm, requests, ignore_eos=args.ignore_eos,
                         temperature=args.temperature, seed=args.seed,
                         use_tqdm=not args.disable_tqdm)
    res.update(dataset=args.dataset_name, weights=weight_format_of(llm),
               dtype=llm.engine.config.dtype)
    print(f"Throughput: {res['requests_per_second']:.2f} requests/s, "
          f"{res['tokens_per_second']:.2f} total tokens/s, "
          f"{res['output_tokens_per_second']:.2f} output tokens/s "
          f"({res['num_requests']} requests, {res['total_input_tokens']} input + "
          f"{res['total_output_tokens']} output tokens in {res['elapsed_time']:.2f} s)")
    _report_spec_decoding(llm, res)
    _write_json(args.output_json, res)
    return 0


def _run_latency(args) -> int:
    from llmserve.benchmarks.engine import weight_format_of
    from llmserve.benchmarks.offline import run_latency
    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.engine.llm import LLM
    from llmserve.engine.llm_engine import LLMEngine

    llm = LLM.from_engine(LLMEngine.from_engine_args(EngineArgs.from_cli_args(args)))
    res = run_latency(llm, args.batch_size, args.input_len, args.output_len,
                      num_iters=args.num_iters, num_iters_warmup=args.num_iters_warmup,
                      seed=args.seed)
    res.update(weights=weight_format_of(llm), dtype=llm.engine.config.dtype)
    for key, label in (("batch_latency_ms", "batch latency"), ("ttft_ms", "TTFT"),
                       ("decode_step_ms", "decode step")):
        d = res[key]
        print(f"{label + ' (ms):':<22} mean {d['mean']:9.2f}  median {d['median']:9.2f}  "
              f"p90 {d['p90']:9.2f}  p99 {d['p99']:9.2f}")
    print(f"{'decode tokens/s:':<22} {res['decode_tokens_per_second']:.1f} "
          f"(batch {args.batch_size} / median step)")
    _report_spec_decoding(llm, res)
    _write_json(args.output_json, res)
    return 0


# ---------------------------------------------------------------- serve
@functools.lru_cache(maxsize=4)
def _tokenizer(name: str | None):
    """The tokenizer of a model reference (cached: loading one from GGUF takes seconds)."""
    from llmserve.loader import resolve_model
    from llmserve.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(name))


def _run_serve(args) -> int:
    from llmserve.benchmarks.datasets import load_requests
    from llmserve.benchmarks.metrics import calculate_metrics, format_metrics, parse_goodput
    from llmserve.benchmarks.serve import ServeConfig, run_serve

    slos = parse_goodput(args.goodput)
    cfg = ServeConfig(base_url=args.base_url, endpoint=args.endpoint, model=args.model,
                      request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                      ignore_eos=args.ignore_eos, temperature=args.temperature,
                      seed=args.seed, api_key=args.api_key or os.environ.get("OPENAI_API_KEY"))
    tokenizer = _tokenizer(args.tokenizer)
    requests = load_requests(args, tokenizer)
    results, duration, model = asyncio.run(
        run_serve(cfg, requests, tokenizer, use_tqdm=not args.disable_tqdm))
    metrics = calculate_metrics(results, duration, slos)
    print(format_metrics(metrics))
    errors = sorted({r.error for r in results if not r.success})
    for e in errors[:5]:
        print(f"error: {e}", file=sys.stderr)
    _write_json(args.save_result, {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "base_url": args.base_url,
        "endpoint": args.endpoint, "model": model, "dataset": args.dataset_name,
        "num_prompts": len(requests), "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency, "goodput_slos_s": slos,
        **metrics.to_dict(),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "errors": [r.error for r in results]})
    return 0 if metrics.completed else 1


# ---------------------------------------------------------------- parsers
def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine start-up")


def register(subparsers) -> None:
    """Add ``bench`` with its ``throughput``, ``latency`` and ``serve`` subcommands."""
    from llmserve.benchmarks.datasets import add_dataset_args
    from llmserve.engine.arg_utils import EngineArgs

    bench = subparsers.add_parser("bench", help="benchmark the engine or a server",
                                  description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = bench.add_subparsers(dest="bench_command", metavar="KIND", required=True)

    p = sub.add_parser("throughput", help="offline throughput on the LLM engine")
    add_dataset_args(p, with_seed=False)
    p.add_argument("--ignore-eos", action="store_true", help="always generate the full length")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--output-json", default=None, help="write the result here")
    _add_common(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_throughput, command="bench throughput")

    p = sub.add_parser("latency", help="per-step latency of one fixed batch")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--input-len", type=positive_int, default=32)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--num-iters", type=positive_int, default=3)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--output-json", default=None, help="write the result here")
    _add_common(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_latency, command="bench latency")

    p = sub.add_parser("serve", help="load an OpenAI-compatible server and measure it")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model name sent (default: GET /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for prompts and counts (default: the embedded model)")
    p.add_argument("--request-rate", type=_rate, default=float("inf"),
                   help="requests/s, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=positive_int, default=None)
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key", default=None, help="bearer token (default $OPENAI_API_KEY)")
    p.add_argument("--save-result", default=None, metavar="PATH.json",
                   help="write metrics and per-request data here")
    add_dataset_args(p)
    _add_common(p)
    p.set_defaults(func=_run_serve, command="bench serve")

"""``llmserve batch run INPUT --output OUT [--checkpoint DIR]``: an OpenAI Batch API
input file run offline through the engine, resumable.

Results are checkpointed as they finish (``--checkpoint``, default ``OUT.checkpoint``);
running the same command again after a crash, a ``kill -9`` or a spot reclaim skips
every ``custom_id`` already done and runs the rest. SIGTERM (a reclaim notice) or
Ctrl-C stops new requests and gives those in flight ``--grace-period`` seconds to
finish and be checkpointed (exit 143 / 130; run again to resume). Once every request
has a result, ``OUT`` is written (atomically) with one line per request in input
order: successes and errors, as vLLM's ``run_batch`` writes them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time

logger = logging.getLogger("llmserve.batch")


def register(subparsers) -> None:
    """Add ``batch run`` (called by :mod:`llmserve.entrypoints.cli`)."""
    from llmserve.engine.arg_utils import EngineArgs

    p = subparsers.add_parser("batch", help="run OpenAI Batch API files offline (resumable)",
                              description="Run batch files through the engine.")
    sub = p.add_subparsers(dest="batch_command", metavar="COMMAND")
    r = sub.add_parser("run", help="run an OpenAI batch input file (JSONL) to an output file",
                       description=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("input", help="the batch input (JSONL: custom_id, method, url, body)")
    r.add_argument("-o", "--output", required=True, help="where to write the results (JSONL)")
    r.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="checkpoint directory (default: OUTPUT.checkpoint)")
    r.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in the engine at once (default: --max-num-seqs)")
    r.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds requests in flight may take to finish after SIGTERM "
                        "(default 30)")
    r.add_argument("--served-model-name", nargs="+", default=None,
                   help="names a request body may give as `model` (default: the --model "
                        "value, or smollm2-135m-instruct)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("-v", "--verbose", action="store_true", help="log engine start-up")
    EngineArgs.add_cli_args(r)
    r.set_defaults(func=run_batch_cmd)
    p.set_defaults(func=lambda _: (p.print_help(), 2)[1])


def run_batch_cmd(args: argparse.Namespace) -> int:
    """Returns 0 when every request has a result, 143 / 130 after SIGTERM / SIGINT.

    Raises:
        ValueError: unreadable or invalid input, a checkpoint of another input, bad
            engine options.
    """
    from llmserve.entrypoints.batch.batch_format import digest, parse_batch
    from llmserve.entrypoints.batch.checkpoint import CheckpointStore

    try:
        with open(args.input, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"input {args.input}: cannot read ({e})") from None
    items = parse_batch(text, args.input)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.grace_period < 0:
        raise ValueError(f"--grace-period must be >= 0, got {args.grace_period}")
    ckpt_dir = args.checkpoint or args.output + ".checkpoint"
    store = CheckpointStore(ckpt_dir, digest(text), len(items))
    try:
        return asyncio.run(_run(args, items, store, ckpt_dir))
    finally:
        store.close()


async def _run(args, items, store, ckpt_dir: str) -> int:
    from tqdm import tqdm

    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.engine.async_llm import AsyncLLM
    from llmserve.entrypoints.batch.checkpoint import write_atomic
    from llmserve.entrypoints.batch.runner import handler_executor, run_batch
    from llmserve.entrypoints.openai.serving_chat import OpenAIServingChat
    from llmserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from llmserve.loader.source import DEFAULT_MODEL_NAME

    done = len(store.done())
    print(f"llmserve batch: {len(items)} requests, {done} already done (checkpoint "
          f"{ckpt_dir}), {len(items) - done} to run", file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    caught: list[int] = []

    def on_signal(signum: int) -> None:
        if not caught:
            print(f"\nllmserve batch: {signal.Signals(signum).name}: finishing requests in "
                  f"flight (up to {args.grace_period:g} s)", file=sys.stderr, flush=True)
        caught.append(signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    engine = None
    try:
        if done < len(items):
            engine = await loop.run_in_executor(
                None, AsyncLLM.from_engine_args, EngineArgs.from_cli_args(args))
            names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
            completion = OpenAIServingCompletion(engine, names)
            chat = OpenAIServingChat(engine, names)
            limit = args.max_concurrency or engine.max_num_seqs
            bar = tqdm(total=len(items), initial=done, unit="req", file=sys.stderr,
                       disable=args.no_progress, dynamic_ncols=True, desc="batch")
            t0 = time.perf_counter()
            try:
                result = await run_batch(items, handler_executor(completion, chat), store,
                                         limit, stop, args.grace_period,
                                         on_result=lambda ok: bar.update(1))
            finally:
                bar.close()
            elapsed = time.perf_counter() - t0
            print(f"llmserve batch: submitted {result.submitted}, finished {result.finished}"
                  f", unfinished {result.unfinished} in {elapsed:.2f} s "
                  f"({result.finished / max(elapsed, 1e-9):.2f} requests/s)", file=sys.stderr,
                  flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if engine is not None:
            engine.shutdown()
    ok, failed = store.counts()
    if ok + failed < len(items):
        print(f"llmserve batch: stopped with {ok + failed} of {len(items)} done; run the "
              f"same command again to resume from {ckpt_dir}", file=sys.stderr)
        return 130 if caught and caught[0] == signal.SIGINT else 143
    write_atomic(args.output, store.lines())
    print(f"llmserve batch: wrote {args.output} ({ok} succeeded, {failed} failed)",
          file=sys.stderr)
    return 0

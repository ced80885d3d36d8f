"""The ``llmserve`` command line: ``generate``, ``serve``, ``plan``, ``gateway``, ``router``,
``up``/``down``/``status``/``render``/``autoscale``, ``registry``."""

from __future__ import annotations

import argparse
import logging
import sys

from llmserve import __version__


def _add_generate(subparsers) -> None:
    from llmserve.engine.arg_utils import EngineArgs

    p = subparsers.add_parser(
        "generate", help="generate text offline with the engine",
        description="Generate text for one prompt through the llmserve engine.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file ('-' = stdin)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128, help="max new tokens (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--sampling-seed", dest="sampling_seed", type=int, default=None,
                   help="per-request sampling seed")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine start-up")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_generate)


def _read_prompt(args) -> str:
    if args.prompt_file:
        if args.prompt_file == "-":
            return sys.stdin.read()
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    if args.prompt is not None:
        return args.prompt
    return "Hello! Tell me about yourself." if args.chat else "The capital of France is"


def _run_generate(args) -> int:
    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.engine.output_processor import RequestOutputKind
    from llmserve.sampling_params import SamplingParams
    from llmserve.tokenizer import apply_chat_template

    seed = args.sampling_seed if args.sampling_seed is not None else (
        args.seed if args.temperature > 0 else None)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, stop=args.stop, seed=seed)
    text = _read_prompt(args)
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": text})
        prompt = {"prompt_token_ids": apply_chat_template(engine.tokenizer, messages)}
    else:
        prompt = text
    kind = RequestOutputKind.DELTA if args.stream else RequestOutputKind.FINAL_ONLY
    engine.add_request("cli-0", prompt, params, kind)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if args.stream:
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
            if out.finished:
                final = out
    if not args.stream and final is not None:
        sys.stdout.write(final.outputs[0].text)
    sys.stdout.write("\n")
    if final is not None and args.verbose:
        o = final.outputs[0]
        m = final.metrics
        print(f"[{len(final.prompt_token_ids)} prompt tokens, {len(o.token_ids)} generated, "
              f"finish_reason={o.finish_reason}, TTFT {m.time_to_first_token:.3f} s, "
              f"E2E {m.e2e_latency:.3f} s]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmserve", description="llmserve: LLM inference engine and serving stack")
    parser.add_argument("--version", action="version", version=f"llmserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(subparsers)
    import importlib

    from llmserve.gateway.cli import add_parser as _add_gateway  # serving plane, no torch

    _add_gateway(subparsers)

    # optional subcommands, each a module with register(subparsers)
    for mod_name in ("llmserve.entrypoints.openai.serve_cmd", "llmserve.entrypoints.plan_cmd",
                     "llmserve.entrypoints.bench_cmd", "llmserve.entrypoints.audit_cmd",
                     "llmserve.entrypoints.router_cmd", "llmserve.entrypoints.tune_cmd",
                     "llmserve.deploy.cli", "llmserve.registry.cli",
                     "llmserve.entrypoints.batch.batch_cmd", "llmserve.compress.cli",
                     "llmserve.compress.distill_cli", "llmserve.compress.prune_cli",
                     "llmserve.entrypoints.export_cmd"):
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if not mod_name.startswith(e.name or "?"):
                raise
            continue
        mod.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gateway"]:  # the gateway never imports torch or the engine
        from llmserve.gateway.cli import main as gateway_main

        return gateway_main(argv[1:])
    from llmserve.deploy.cli import COMMANDS as _DEPLOY_COMMANDS

    if argv[:1] and argv[0] in (*_DEPLOY_COMMANDS, "registry"):  # serving plane, no torch
        if argv[0] == "registry":
            from llmserve.registry.cli import main as registry_main

            return registry_main(argv[1:])
        from llmserve.deploy.cli import main as deploy_main

        return deploy_main(argv)
    if argv[:2] == ["quantize", "advise"]:  # its own parser (quantize's positional is MODEL)
        argv = ["quantize-advise", *argv[2:]]
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"llmserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

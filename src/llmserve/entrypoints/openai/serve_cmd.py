"""``llmserve serve``: the OpenAI-compatible HTTP server (uvicorn + FastAPI over
:class:`~llmserve.engine.async_llm.AsyncLLM`).

Start-up: the socket is bound first and a line ``llmserve: listening on
http://HOST:PORT`` is printed (with ``--port 0`` it shows the port the OS chose);
the model then loads in the background (``/health`` is 503 until a second line says
it is ready). A model that fails to load stops the server with exit code 1.

SIGTERM (and Ctrl-C) shut down gracefully: stop accepting connections, let requests
in flight finish for up to ``--shutdown-timeout`` seconds, abort the rest, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

DEFAULT_PORT = 8000
BACKSTOP_S = 5.0  # uvicorn cancels handlers this long after the engine aborted them
logger = logging.getLogger("llmserve.server")


def register(subparsers) -> None:
    """Add the ``serve`` subcommand (called by :mod:`llmserve.entrypoints.cli`)."""
    from llmserve.engine.arg_utils import EngineArgs

    p = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible API over HTTP",
        description="Serve a model over the OpenAI-compatible HTTP API: /v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /version, /metrics, "
                    "/tokenize, /detokenize.")
    p.add_argument("model_tag", nargs="?", default=None,
                   help="the model, as vLLM's `serve MODEL` (same as --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port to bind (default {DEFAULT_PORT}; 0 = any free port)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients pass as `model` (default: the --model value, or "
                        "smollm2-135m-instruct); the first is reported in responses")
    p.add_argument("--api-key", default=os.environ.get("LLMSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $LLMSERVE_API_KEY, else no key)")
    p.add_argument("--register-with", action="append", default=[], metavar="ROUTER_URL",
                   help="once ready, join this `llmserve router` (POST /workers); leave it "
                        "(drain) on SIGTERM (repeatable)")
    p.add_argument("--advertise-url", default=None, metavar="URL",
                   help="the URL routers should use for this worker (default: the bound "
                        "address; needed with --host 0.0.0.0)")
    p.add_argument("--allow-unauthenticated-metrics", action="store_true",
                   help="with --api-key, leave /metrics open (e.g. for a Prometheus "
                        "scraper without credentials)")
    p.add_argument("--max-waiting-requests", type=_non_negative, default=None,
                   help="admit at most --max-num-seqs + this many requests (each choice "
                        "of each prompt counts); more is a 503 with Retry-After "
                        "(default: no limit)")
    p.add_argument("--max-request-body-bytes", type=_body_size, default=None,
                   help="answer 413 to a larger request body, before reading it (bytes, "
                        "or a size such as 4MiB; default 16MiB)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let chat requests replace the model's chat template (`chat_template` "
                        "or `chat_template_kwargs.chat_template`; still sandboxed and "
                        "bounded); without it such requests are a 400, as in vLLM")
    p.add_argument("--tool-call-parser", default="hermes",
                   choices=["hermes", "llama3_json", "mistral", "none"],
                   help="how tool_choice=auto outputs are read into tool_calls (default "
                        "hermes: <tool_call> JSON, Qwen2.5 and ChatML models; none: off)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility (auto tool choice is on whenever "
                        "--tool-call-parser is set)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds that requests in flight may take to finish after SIGTERM "
                        "before they are aborted (default 30)")
    p.add_argument("--batch-dir", default=None, metavar="DIR",
                   help="where the Batch API (/v1/files, /v1/batches) keeps its files and "
                        "checkpoints; a restart resumes unfinished batches (default: a "
                        "temporary directory)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served as `model` NAME, with "
                        "--enable-lora; also vLLM's JSON form '{\"name\": ..., \"path\": ...}'")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="do not log one line per HTTP request")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="server log level")
    p.add_argument("-v", "--verbose", action="store_true", help="same as --log-level debug")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_server)


def _body_size(text: str) -> int:
    from llmserve.utils import parse_size

    try:
        value = parse_size(text, "--max-request-body-bytes")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size >= 1 byte, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (SO_REUSEADDR) and listen. Raises ValueError when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _graceful_server_class(uvicorn):
    class GracefulServer(uvicorn.Server):
        """uvicorn's shutdown (stop accepting, wait for connections), plus: after
        ``drain_timeout`` seconds the engine aborts what is still running, so every
        stream ends cleanly (a ``finish_reason: "abort"`` chunk, then ``[DONE]``).
        uvicorn's own cancellation, ``BACKSTOP_S`` later, is only a backstop."""

        def __init__(self, config, state, drain_timeout: float, registration=None) -> None:
            super().__init__(config)
            self.state, self.drain_timeout = state, drain_timeout
            self.registration = registration

        async def shutdown(self, sockets=None) -> None:
            if self.registration is not None:  # routers stop sending before we drain
                await asyncio.get_running_loop().run_in_executor(
                    None, self.registration.deregister)
            handle = asyncio.get_running_loop().call_later(self.drain_timeout, self._abort_rest)
            try:
                await super().shutdown(sockets)
            finally:
                handle.cancel()

        def _abort_rest(self) -> None:
            engine = self.state.engine
            n = engine.abort_all() if engine is not None else 0
            if n:
                logger.warning("shutdown: aborted %d requests still running after %.0f s",
                               n, self.drain_timeout)

    return GracefulServer


def _init_ray_in_main_thread(engine_args) -> bool:
    """``--distributed-executor-backend ray`` with several ranks: start or join Ray here,
    before the model loads on its thread and before uvicorn's signal handlers go in
    (``ray_executor.init_ray``); True when this process started it."""
    if (engine_args.distributed_executor_backend != "ray"
            or engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size == 1):
        return False
    from llmserve.distributed.ray_executor import init_ray

    return init_ray()


def run_server(args: argparse.Namespace) -> int:
    """Bind, serve until SIGTERM/SIGINT, return the exit code (0, or 1 if the model
    failed to load).

    Raises:
        ValueError: the address cannot be bound.
    """
    import uvicorn

    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.entrypoints.openai.api_server import build_app
    from llmserve.entrypoints.openai.middleware import DEFAULT_MAX_REQUEST_BODY_BYTES
    from llmserve.entrypoints.openai.serving_lora import parse_lora_modules
    from llmserve.loader.source import DEFAULT_MODEL_NAME

    if args.model_tag is not None:
        args.model = args.model_tag
    if getattr(args, "data_parallel_size", 1) != 1:  # replicas behind this front
        from llmserve.entrypoints.openai.data_parallel import run_data_parallel

        return run_data_parallel(args)
    level = "debug" if args.verbose else args.log_level
    logging.getLogger("llmserve").setLevel(level.upper())
    engine_args = EngineArgs.from_cli_args(args)
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    lora_modules = parse_lora_modules(args.lora_modules)  # ValueError: malformed
    if (lora_modules or args.allow_runtime_lora_updating) and not engine_args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    ray_owned = _init_ray_in_main_thread(engine_args)
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    holder: dict = {}
    registration = None
    if args.register_with:
        from llmserve.entrypoints.openai.registration import RouterRegistration

        if args.advertise_url is None and host in ("0.0.0.0", "::"):
            raise ValueError("--register-with with --host 0.0.0.0 needs --advertise-url "
                             "(the address routers can reach)")
        registration = RouterRegistration(args.register_with, args.advertise_url or url)

    def on_failure() -> None:
        holder["server"].should_exit = True

    def on_ready(engine) -> None:
        print(f"llmserve: model {names[0]!r} ready ({engine.engine.config.dtype}, "
              f"max_model_len {engine.max_model_len}); OpenAI API at {url}/v1", flush=True)
        if registration is not None:
            registration.register()

    app = build_app(engine_args, names, api_key=args.api_key,
                    max_waiting_requests=args.max_waiting_requests,
                    max_request_body_bytes=(args.max_request_body_bytes
                                            or DEFAULT_MAX_REQUEST_BODY_BYTES),
                    public_metrics=args.allow_unauthenticated_metrics,
                    on_load_failure=on_failure, on_ready=on_ready,
                    trust_request_chat_template=args.trust_request_chat_template,
                    batch_dir=args.batch_dir, lora_modules=lora_modules,
                    allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                    tool_call_parser=(None if args.tool_call_parser == "none"
                                      else args.tool_call_parser))
    config = uvicorn.Config(app, host=host, port=port, log_level=level,
                            access_log=not args.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=args.shutdown_timeout + BACKSTOP_S,
                            timeout_keep_alive=5)
    server = _graceful_server_class(uvicorn)(config, app.state.server, args.shutdown_timeout,
                                             registration)
    holder["server"] = server
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler
    # makes that a clean exit 0 after a graceful SIGTERM.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    print(f"llmserve: listening on {url} (OpenAI-compatible API; loading "
          f"{names[0]!r}, /health is 503 until ready)", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        if ray_owned:
            import ray

            ray.shutdown()
    code = app.state.server.exit_code
    if code and app.state.server.fatal_error is not None:
        print(f"llmserve serve: error: the engine died: {app.state.server.fatal_error}",
              file=sys.stderr)
    elif code:
        print(f"llmserve serve: error: the model failed to load: "
              f"{app.state.server.load_error}", file=sys.stderr)
    return code

"""The FastAPI application of ``llmserve serve`` (routes as in vLLM's
``vllm/entrypoints/openai/api_server.py``).

=======================  ======  ===================================================
route                    method  answer
=======================  ======  ===================================================
/v1/completions          POST    OpenAI completions (``stream`` as SSE)
/v1/chat/completions     POST    OpenAI chat completions (``stream`` as SSE)
/v1/models               GET     the served model(s)
/health                  GET     200 when ready, 503 while loading or after a failure
/version                 GET     ``{"version": ...}``
/metrics                 GET     Prometheus text format (see :mod:`llmserve.metrics.prometheus`)
/dashboard               GET     live metrics page; ``/metrics/json``, ``/dashboard/data`` its
                                 JSON (:mod:`llmserve.metrics.dashboard`)
/tokenize, /detokenize   POST    vLLM's tokenizer endpoints
/v1/files, /v1/batches   *       OpenAI's Batch API (:mod:`llmserve.entrypoints.batch.api`)
=======================  ======  ===================================================

The model loads in a background thread started by the lifespan, so the port answers
at once: until the engine is ready every model route returns 503. With an API key,
every route but ``/health`` (and ``/metrics`` with ``public_metrics``) needs
``Authorization: Bearer <key>`` (401 otherwise, before the body is read). A request
body over ``max_request_body_bytes`` is a 413 before it is parsed. Tokenization,
chat-template rendering and prompt decoding run on one tokenizer thread, off the event
loop. Every error uses OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from llmserve import __version__
from llmserve.engine.arg_utils import EngineArgs
from llmserve.engine.async_llm import AsyncLLM, EngineShutdownError
from llmserve.entrypoints.batch.api import install_batch_api
from llmserve.entrypoints.openai.kv_digest import DIGEST_PATH, install_kv_digest
from llmserve.entrypoints.openai.middleware import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    RequestBodyLimitMiddleware,
)
from llmserve.entrypoints.openai.openapi import install_openapi, responses
from llmserve.entrypoints.openai.request_id import RequestIdMiddleware
from llmserve.entrypoints.openai.serving_chat import OpenAIServingChat
from llmserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from llmserve.entrypoints.openai.serving_engine import APIError, bad_request, service_unavailable
from llmserve.entrypoints.openai.serving_lora import LoRARegistry, install_lora_routes
from llmserve.metrics.dashboard import DASHBOARD_PATHS, DATA_PATHS, install_server_dashboard
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.protocol import validation_message
from llmserve.protocol.openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    VersionResponse,
)
from llmserve.tokenizer import decode_ids, encode_text

logger = logging.getLogger("llmserve.server")


class ServerState:
    """What the routes share. ``ready`` is set last, after every handler exists."""

    def __init__(self, served_model_names: Sequence[str], max_waiting_requests: int | None,
                 trust_request_chat_template: bool = False,
                 tool_call_parser: str | None = "hermes"):
        self.tool_call_parser = tool_call_parser
        self.lora_registry = None  # a serving_lora.LoRARegistry with --enable-lora
        self.served_model_names = list(served_model_names)
        self.max_waiting_requests = max_waiting_requests
        self.trust_request_chat_template = trust_request_chat_template
        self.stat_logger = PrometheusStatLogger(self.served_model_names[0])
        self.engine: AsyncLLM | None = None
        self.completion: OpenAIServingCompletion | None = None
        self.chat: OpenAIServingChat | None = None
        self.ready = False
        self.load_error: str | None = None
        self.fatal_error: str | None = None  # the engine died after loading
        self.exit_code = 0
        # one thread: HF fast tokenizers are used from one thread here (as in vLLM)
        self.tokenizer_executor = ThreadPoolExecutor(1, thread_name_prefix="llmserve-tokenizer")

    def attach(self, engine: AsyncLLM) -> None:
        args = (engine, self.served_model_names, self.max_waiting_requests,
                self.tokenizer_executor)
        self.completion = OpenAIServingCompletion(*args)
        self.chat = OpenAIServingChat(
            *args, trust_request_chat_template=self.trust_request_chat_template,
            tool_call_parser=self.tool_call_parser)
        self.completion.lora_registry = self.chat.lora_registry = self.lora_registry
        self.engine = engine
        self.ready = True

    def require_engine(self) -> AsyncLLM:
        if self.load_error is not None:
            raise service_unavailable(f"the model failed to load: {self.load_error}")
        if not self.ready or self.engine is None:
            raise service_unavailable("the model is still loading; retry when /health is 200")
        if self.engine.fatal_error is not None:
            raise service_unavailable(f"the engine died: {self.engine.fatal_error}")
        if not self.engine.is_running:
            raise service_unavailable("the engine is not running (shutting down)")
        return self.engine


class APIKeyMiddleware:
    """Pure ASGI middleware: every route but ``open_paths`` needs ``Authorization:
    Bearer <key>``; the 401 goes out before the body is read."""

    def __init__(self, app: Any, api_key: str, open_paths: Sequence[str] = ("/health",)) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths \
                and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer "
                                    "<key>'", "invalid_request_error", None, "invalid_api_key")
                await JSONResponse(err.body(), 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return JSONResponse(bad_request(message, param).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), kind, None,
                                     exc.status_code).body(), exc.status_code)

    @app.exception_handler(EngineShutdownError)
    async def _engine_gone(_: Request, exc: EngineShutdownError) -> JSONResponse:
        return JSONResponse(service_unavailable(str(exc)).body(), 503)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                     "server_error", None, 500).body(), 500)


def build_app(engine_args: EngineArgs, served_model_names: Sequence[str],
              api_key: str | None = None, max_waiting_requests: int | None = None,
              on_load_failure: Callable[[], None] | None = None,
              on_ready: Callable[[AsyncLLM], None] | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              public_metrics: bool = False,
              trust_request_chat_template: bool = False,
              batch_dir: str | None = None,
              tool_call_parser: str | None = "hermes",
              lora_modules: Sequence[tuple[str, str]] = (),
              allow_runtime_lora_updating: bool = False) -> FastAPI:
    """The application; its lifespan loads the model in a background thread.

    Args:
        served_model_names: names accepted as ``model``; the first is reported.
        api_key: when set, every route but ``/health`` needs it (see ``public_metrics``).
        max_waiting_requests: admit at most ``max_num_seqs + max_waiting_requests``
            engine requests; more is a 503 with ``Retry-After`` (None: no limit).
        max_request_body_bytes: a larger request body is a 413, before it is parsed.
        public_metrics: with ``api_key``, leave ``/metrics`` open (for a scraper).
        trust_request_chat_template: let chat requests bring their own chat template.
        tool_call_parser: reads ``tool_choice: auto`` outputs (``tool_parsers.py``; None: off).
        on_load_failure: called (from the loader thread) when loading fails, e.g. to
            stop the server; ``app.state.server.exit_code`` is then 1.
        on_ready: called (from the loader thread) once the engine runs.
        batch_dir: where the Batch API keeps files and batches (None: a temporary
            directory; see :mod:`llmserve.entrypoints.batch.api`).
        lora_modules: ``(name, PEFT directory)`` adapters served from the start (needs
            ``engine_args.enable_lora``); see :mod:`~llmserve.entrypoints.openai.serving_lora`.
        allow_runtime_lora_updating: add ``/v1/load_lora_adapter`` and
            ``/v1/unload_lora_adapter``.
    """
    state = ServerState(served_model_names, max_waiting_requests, trust_request_chat_template,
                        tool_call_parser)
    state.lora_registry = LoRARegistry() if engine_args.enable_lora else None
    if lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for name, path in lora_modules:
        state.lora_registry.add(name, path)

    def load() -> None:
        try:
            engine = AsyncLLM.from_engine_args(engine_args, [state.stat_logger])
            for lora in state.lora_registry.list() if state.lora_registry else ():
                engine.engine.add_lora(lora)  # ValueError: a bad --lora-modules adapter
        except Exception as e:  # ValueError: bad model or option; anything else: a bug
            logger.error("the model failed to load: %s", e)
            state.load_error, state.exit_code = str(e), 1
            if on_load_failure is not None:
                on_load_failure()
            return
        state.attach(engine)

        def on_fatal_error(error: BaseException) -> None:  # a rank died: exit non-zero
            state.fatal_error, state.exit_code = str(error), 1
            if on_load_failure is not None:
                on_load_failure()
        engine.on_fatal_error = on_fatal_error
        if on_ready is not None:
            on_ready(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        threading.Thread(target=load, name="llmserve-loader", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.shutdown()
        state.tokenizer_executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="llmserve", version=__version__, lifespan=lifespan)
    app.state.server = state
    app.add_middleware(RequestBodyLimitMiddleware, max_bytes=max_request_body_bytes)
    app.add_middleware(RequestIdMiddleware)  # outside the limit: a 413 carries the id too
    if api_key:  # added last = outermost: a request without the key is never read
        open_paths = ("/health", *DASHBOARD_PATHS)
        if public_metrics:
            open_paths += ("/metrics", *DATA_PATHS, DIGEST_PATH)
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=open_paths)
    _install_error_handlers(app)
    install_openapi(app, api_key_required=bool(api_key))

    @app.get("/health", response_class=Response, responses=responses(None, 503))
    async def health() -> Response:
        state.require_engine()
        return Response(status_code=200)  # no body, as vLLM's /health

    install_kv_digest(app, state)

    @app.get("/version", responses=responses(VersionResponse))
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses=responses(None, media_type="text/plain"))
    async def metrics() -> Response:
        body, content_type = state.stat_logger.render()
        return Response(body, media_type=content_type)

    install_server_dashboard(app, state.stat_logger.registry, served_model_names[0])
    install_batch_api(app, state, batch_dir)
    if allow_runtime_lora_updating:
        install_lora_routes(app, state)

    @app.get("/v1/models", responses=responses(ModelList, 503))
    async def models() -> Response:
        engine = state.require_engine()
        cards = [ModelCard(id=name, root=engine.engine.config.model,
                           max_model_len=engine.max_model_len)
                 for name in state.served_model_names]
        cards += [ModelCard(id=lora.lora_name, root=lora.lora_path,
                            parent=state.served_model_names[0],
                            max_model_len=engine.max_model_len, lora_int_id=lora.lora_int_id)
                  for lora in (state.lora_registry.list() if state.lora_registry else ())]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.post("/v1/completions",
              responses=responses(CompletionResponse, 400, 404, 500, 503, stream=True))
    async def completions(req: CompletionRequest, raw_request: Request) -> Response:
        state.require_engine()
        return await state.completion.create_completion(req, raw_request)

    @app.post("/v1/chat/completions",
              responses=responses(ChatCompletionResponse, 400, 404, 500, 503, stream=True))
    async def chat_completions(req: ChatCompletionRequest, raw_request: Request) -> Response:
        state.require_engine()
        return await state.chat.create_chat_completion(req, raw_request)

    @app.post("/tokenize", responses=responses(TokenizeResponse, 400, 404, 503))
    async def tokenize(req: TokenizeRequest) -> Response:
        engine = state.require_engine()
        state.chat.model_name(req.model)
        if req.messages is None and req.prompt is None:
            raise bad_request("send either prompt or messages", "prompt")

        def run() -> str:  # on the tokenizer thread
            tok = engine.tokenizer
            if req.messages is not None:
                ids = state.chat.render(ChatCompletionRequest(
                    messages=req.messages, add_generation_prompt=req.add_generation_prompt))
            else:
                try:
                    ids = encode_text(tok, req.prompt,
                                      add_special_tokens=req.add_special_tokens)
                except ValueError as e:
                    raise bad_request(str(e), "prompt") from None
            strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
            return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len,
                                    tokens=ids, token_strs=strs).model_dump_json()

        body = await state.chat.run_tokenizer(run)
        return Response(body, media_type="application/json")

    @app.post("/detokenize", responses=responses(DetokenizeResponse, 400, 404, 503))
    async def detokenize(req: DetokenizeRequest) -> Response:
        engine = state.require_engine()
        state.chat.model_name(req.model)
        vocab = engine.engine.config.model_config.vocab_size

        def run() -> str:  # on the tokenizer thread
            bad = [t for t in req.tokens if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"tokens: {bad[0]} is not a token id in [0, {vocab})",
                                  "tokens")
            return DetokenizeResponse(prompt=decode_ids(engine.tokenizer, req.tokens)
                                      ).model_dump_json()

        body = await state.chat.run_tokenizer(run)
        return Response(body, media_type="application/json")

    @app.get("/tokenizer_info", responses=responses(TokenizerInfoResponse, 503))
    async def tokenizer_info() -> Response:  # vLLM's; lm-eval's remote tokenizer reads it
        engine = state.require_engine()
        tok = engine.tokenizer
        info = TokenizerInfoResponse(
            tokenizer_class=type(tok).__name__, eos_token=tok.eos_token, bos_token=tok.bos_token,
            pad_token=tok.pad_token, chat_template=getattr(tok, "chat_template", None),
            model_max_length=engine.max_model_len)
        return Response(info.model_dump_json(), media_type="application/json")

    return app

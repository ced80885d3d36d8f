"""What completions and chat share: errors in OpenAI's shape, model and capacity
checks, request fields -> :class:`SamplingParams`, the context-length check, the
``n`` fan-out, and iteration over several request streams.

Error statuses (OpenAI API reference, "Error codes"; vLLM's server): 400 invalid
parameters, 401 bad API key, 404 unknown model or route, 503 loading or overloaded,
500 an engine failure.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from llmserve.engine.async_llm import (
    AsyncLLM,
    EngineOverloadedError,
    EngineShutdownError,
    NewRequest,
    RequestStream,
    merge_delta,
)
from llmserve.outputs import RequestOutput
from llmserve.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    SamplingFields,
)
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.token_bytes import TokenBytes

MAX_N = 128  # most choices one request may ask for
RETRY_AFTER_S = 1  # the Retry-After of an "overloaded" 503 (RFC 9110, section 10.2.3)


class APIError(Exception):
    """An error to send as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)
        self.headers = headers  # extra response headers, e.g. Retry-After

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code)).model_dump()


_FIELD_RE = re.compile(r"^([a-z_]+)")
_FIELDS = (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)) - {
    "model"}


def bad_request(message: str, param: str | None = None) -> APIError:
    """400; ``param`` defaults to the request field named at the start of ``message``
    (messages of SamplingParams, the tokenizer and the engine start with it)."""
    if param is None:
        m = _FIELD_RE.match(message)
        word = m.group(1) if m else ""
        param = word if word in _FIELDS else ("prompt" if word.startswith("prompt") else None)
    return APIError(400, message, "invalid_request_error", param)


def service_unavailable(message: str, retry_after: int | None = None) -> APIError:
    """503; ``retry_after`` (seconds) becomes a ``Retry-After`` header."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return APIError(503, message, "service_unavailable_error", None, 503, headers)


def sse(payload: str) -> str:
    """One server-sent event (https://html.spec.whatwg.org/#server-sent-events)."""
    return f"data: {payload}\n\n"


def sse_error(e: BaseException) -> str:
    """The error event sent when a stream fails after its 200 header went out."""
    err = e if isinstance(e, APIError) else APIError(
        500, f"{type(e).__name__}: {e}", "server_error", None, 500)
    return sse(json.dumps(err.body(), ensure_ascii=False))


@dataclass
class PromptInput:
    """A tokenized prompt; ``text`` is None when it came as token ids (decoded lazily)."""

    token_ids: list[int]
    text: str | None = None
    cache_salt: str | None = None
    lora_request: Any = None  # the LoRA adapter the request's `model` names (serving_lora)

    def as_engine_prompt(self) -> dict[str, Any]:
        prompt = {"prompt_token_ids": self.token_ids, "prompt": self.text}
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        if self.lora_request is not None:
            prompt["lora_request"] = self.lora_request
        return prompt


LOGPROB_FLOOR = -9999.0  # -inf is not JSON; vLLM clamps the same way


def prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token None (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` (-inf clamped to LOGPROB_FLOOR)."""
    if entries is None:
        return None
    return [None if e is None else {
        str(tid): {"logprob": max(lp.logprob, LOGPROB_FLOOR), "rank": lp.rank,
                   "decoded_token": lp.decoded_token} for tid, lp in e.items()}
        for e in entries]


def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """``response_format`` (OpenAI) or vLLM's ``guided_*`` / ``structured_outputs``
    extras -> :class:`StructuredOutputsParams`. Raises APIError 400 naming the field
    when several are set or one is malformed."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise bad_request("response_format.json_schema.schema is required for type "
                              "json_schema", "response_format")
        found.append(("response_format", {"json": rf.json_schema.json_schema}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            found.append((name, {key: getattr(req, name)}))
    if req.structured_outputs:
        found.append(("structured_outputs", dict(req.structured_outputs)))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request("set one structured-output constraint, got "
                          + ", ".join(name for name, _ in found), found[1][0])
    name, kw = found[0]
    try:
        so = StructuredOutputsParams(**kw)
    except (TypeError, ValueError) as e:
        raise bad_request(f"{name}: {e}", name) from None
    so.source_field = name  # the request field that compile errors name
    return so


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def fan_out(request_id: str, params: SamplingParams, n: int
            ) -> list[tuple[str, SamplingParams, str | None]]:
    """``n`` choices as ``n`` engine requests ``{id}-{i}`` (seeds ``seed + i``, as
    vLLM), each with the id of the request it forks from: choices 1..n-1 share
    choice 0's prompt KV once it is computed (copy-on-write), so the prompt is
    computed once.
    """
    if n == 1:
        return [(request_id, params, None)]
    out = []
    for i in range(n):
        p = params.clone()
        if p.seed is not None:
            p.seed = params.seed + i
        # prompt logprobs need each choice's own prefill (a fork computes one token)
        fork = i and params.prompt_logprobs is None
        out.append((f"{request_id}-{i}", p, f"{request_id}-0" if fork else None))
    return out


class OpenAIServing:
    """Base of the completions and chat handlers.

    Args:
        engine: the running engine.
        served_model_names: names a request may pass as ``model``; the first is reported.
        max_waiting_requests: admit at most ``max_num_seqs + max_waiting_requests``
            engine requests at once (each choice of each prompt is one); more is a 503
            with ``Retry-After`` (None: no limit).
        tokenizer_executor: where tokenization, chat-template rendering and prompt
            decoding run, off the event loop (None: the loop's default executor).
    """

    def __init__(self, engine: AsyncLLM, served_model_names: Sequence[str],
                 max_waiting_requests: int | None = None,
                 tokenizer_executor: Executor | None = None) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.max_waiting_requests = max_waiting_requests
        self.max_num_admitted = (None if max_waiting_requests is None
                                 else engine.max_num_seqs + max_waiting_requests)
        self.tokenizer_executor = tokenizer_executor
        self.token_bytes = TokenBytes(engine.tokenizer)  # logprobs' raw token bytes

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    lora_registry: Any = None  # a serving_lora.LoRARegistry (--enable-lora), else None

    def lora_request_for(self, model: str | None) -> Any:
        """The LoRA adapter served as ``model`` (None: the base model)."""
        return None if self.lora_registry is None else self.lora_registry.get(model)

    def model_name(self, requested: str | None) -> str:
        """The name to report. Raises APIError 404 for a model we do not serve
        (neither a served name nor a LoRA adapter's)."""
        if requested is None or requested in self.served_model_names:
            return requested or self.served_model_names[0]
        if self.lora_request_for(requested) is not None:
            return requested
        adapters = [r.lora_name for r in self.lora_registry.list()] if self.lora_registry \
            else []
        raise APIError(404, f"The model `{requested}` does not exist. Served: "
                            f"{', '.join(self.served_model_names + adapters)}",
                       "invalid_request_error", "model", "model_not_found")

    def check_capacity(self, num_seqs: int) -> None:
        """A cheap early refusal, before the prompt is tokenized: 503 (``Retry-After``)
        when ``num_seqs`` more engine requests cannot be admitted now. Admission itself
        is decided, exactly, by :meth:`start`."""
        limit = self.max_num_admitted
        if limit is not None and num_seqs <= limit \
                and self.engine.num_admitted + num_seqs > limit:  # more than limit: a 400
            raise self._overloaded(self.engine.num_admitted)

    def _overloaded(self, num_admitted: int) -> APIError:
        return service_unavailable(
            f"the server is overloaded: {num_admitted} requests are running or waiting "
            f"(--max-num-seqs {self.engine.max_num_seqs} + --max-waiting-requests "
            f"{self.max_waiting_requests}); retry later", retry_after=RETRY_AFTER_S)

    async def run_tokenizer(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the tokenizer executor, so that a large input
        (megabytes to tokenize, render or decode) never blocks the event loop."""
        return await asyncio.get_running_loop().run_in_executor(
            self.tokenizer_executor, functools.partial(fn, *args, **kwargs))

    def check_length(self, prompt_len: int, max_tokens: int | None,
                     field: str = "max_tokens") -> int:
        """Resolve ``max_tokens`` against the context and the KV cache, as vLLM and
        OpenAI do for the context.

        A sequence can never hold more tokens than the whole KV cache
        (``max_kv_tokens``, which may be less than ``max_model_len`` with a small
        ``--kv-cache-memory``): a request that would need more is refused here rather
        than cut short later with ``finish_reason: "length"``.

        Returns:
            ``max_tokens``, or all the room left (context and KV cache) when it is None.

        Raises:
            APIError 400: the prompt leaves no room, or prompt + max_tokens is over
                ``max_model_len`` or over what the KV cache holds.
        """
        limit = self.engine.max_model_len
        kv_tokens = self.engine.engine.max_kv_tokens
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt has {prompt_len} tokens (at least one output token must fit). "
                f"Please reduce the length of the prompt.", "prompt")
        if max_tokens is None:  # a prompt over the KV cache is refused by the engine
            return max(min(limit, kv_tokens) - prompt_len, 1)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return max_tokens  # SamplingParams says what is wrong
        total = prompt_len + max_tokens
        if total > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {total} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the length of the prompt "
                f"or completion.", field)
        if total > kv_tokens:
            raise bad_request(
                f"This server's KV cache holds {kv_tokens} tokens, and one request can never "
                f"grow past it. However, you requested {total} tokens ({prompt_len} in the "
                f"prompt, {max_tokens} in the completion). Please reduce {field} to at most "
                f"{max(kv_tokens - prompt_len, 0)} or the length of the prompt.", field)
        return max_tokens

    async def compile_structured(self, params: SamplingParams) -> None:
        """Compile the request's grammar in a worker thread (cached per spec), so the
        engine step that admits it never waits. Raises APIError 400 for a bad spec."""
        so = params.structured_outputs
        if so is None or so.compiled is not None:
            return
        try:
            await asyncio.to_thread(self.engine.engine.structured_output.compile, so)
        except ValueError as e:
            raise bad_request(str(e), getattr(so, "source_field", "response_format")) from None

    def sampling_params(self, req: SamplingFields, max_tokens: int,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        """Request fields -> SamplingParams (OpenAI defaults). Raises APIError 400."""
        logit_bias = None
        if req.logit_bias:
            try:
                logit_bias = {int(k): v for k, v in req.logit_bias.items()}
            except ValueError:
                raise bad_request("logit_bias keys must be token ids (integers as strings)",
                                  "logit_bias") from None
            vocab = self.engine.engine.config.model_config.vocab_size
            bad = [t for t in logit_bias if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"logit_bias: {bad[0]} is not a token id in [0, {vocab})",
                                  "logit_bias")
        if not 1 <= req.n <= MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {req.n}", "n")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true",
                              "stream_options")
        kw = dict(temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                  presence_penalty=req.presence_penalty,
                  frequency_penalty=req.frequency_penalty, top_k=req.top_k, min_p=req.min_p,
                  repetition_penalty=req.repetition_penalty,
                  kv_eviction_policy=req.kv_eviction_policy,
                  kv_budget_tokens=req.kv_budget_tokens, num_sink_tokens=req.num_sink_tokens)
        try:
            return SamplingParams(
                n=1, max_tokens=max_tokens, stop=req.stop, ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids,
                logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
                prompt_logprobs=(prompt_logprobs if prompt_logprobs is not None
                                 else req.prompt_logprobs),
                structured_outputs=(structured if structured is not None
                                    else structured_outputs_of(req)),
                logit_bias=logit_bias,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                **{k: v for k, v in kw.items() if v is not None})
        except ValueError as e:
            raise bad_request(str(e)) from None

    async def start(self, base_id: str, prompts: Sequence[tuple[PromptInput, SamplingParams]],
                    n: int, priority: int = 0) -> list[RequestStream]:
        """Admit and add every (prompt, choice) to the engine at once, all or none;
        streams in choice order (prompt-major: choice ``p * n + i``).

        Raises:
            APIError: 400 for the engine's ValueError or a request that needs more
                sequences than can ever be admitted (nothing is left running); 503 (with
                ``Retry-After``) when admitting it would exceed ``max_num_seqs +
                max_waiting_requests``, or when the engine is shutting down.
        """
        if not self.engine.is_running:
            raise service_unavailable("the engine is not running (shutting down)")
        for _, params in prompts:
            await self.compile_structured(params)
        jobs = []
        for p, (prompt, params) in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{p}"
            jobs += [NewRequest(sub_id, prompt.as_engine_prompt(), sub_params, priority,
                                fork_from=leader)
                     for sub_id, sub_params, leader in fan_out(rid, params, n)]
        limit = self.max_num_admitted
        if limit is not None and len(jobs) > limit:
            raise bad_request(
                f"this request needs {len(jobs)} sequences ({len(prompts)} prompts x n={n}) "
                f"but at most {limit} are admitted at once (--max-num-seqs "
                f"{self.engine.max_num_seqs} + --max-waiting-requests "
                f"{self.max_waiting_requests})", "n")
        try:
            return await self.engine.add_requests(jobs, max_num_admitted=limit)
        except EngineOverloadedError as e:
            raise self._overloaded(e.num_admitted) from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        except EngineShutdownError as e:
            raise service_unavailable(str(e)) from None


async def iterate_streams(streams: Sequence[RequestStream]
                          ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(stream index, output)`` from several streams as outputs arrive.
    An exception from any stream is re-raised; the caller aborts the streams."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def collect(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """Wait for every stream to finish; one merged (whole) output per stream."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in iterate_streams(streams):
        finals[i] = out if finals[i] is None else merge_delta(finals[i], out)
    return finals  # type: ignore[return-value]


async def until_disconnect(raw_request: Request, coro: Any) -> Any:
    """Run ``coro`` unless the client disconnects first (then cancel it, which aborts
    its engine requests, and raise ``asyncio.CancelledError``). The request body must
    already be read; vLLM's ``with_cancellation`` does the same."""
    work = asyncio.ensure_future(coro)

    async def watch() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        raise asyncio.CancelledError("client disconnected")
    return work.result()

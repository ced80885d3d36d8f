"""``POST /v1/chat/completions`` (OpenAI API reference, "Chat"; vLLM's
``serving_chat.py``): the model's chat template over the messages, ``n``, chat
``logprobs``/``top_logprobs``, and streaming as ``chat.completion.chunk`` events
ending in ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llmserve.chat_template import (
    DEFAULT_MAX_RENDERED_CHARS,
    ChatTemplateError,
    RenderLimits,
    plain_value,
)
from llmserve.engine.async_llm import RequestStream
from llmserve.entrypoints.openai.serving_engine import (
    LOGPROB_FLOOR,
    OpenAIServing,
    PromptInput,
    bad_request,
    collect,
    iterate_streams,
    prompt_logprobs_json,
    random_id,
    sse,
    sse_error,
    until_disconnect,
)
from llmserve.entrypoints.openai.tool_parsers import (
    ParsedToolCall,
    StreamingToolCalls,
    ToolParser,
    tool_parser_names,
)
from llmserve.entrypoints.openai.tools import (
    constrained_output,
    output_parser,
    prepare_messages,
    validate_tools,
)
from llmserve.outputs import SampleLogprobs
from llmserve.protocol.openai import (
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    TopLogprob,
    usage_info,
)
from llmserve.sampling_params import MAX_LOGPROBS
from llmserve.token_bytes import TokenBytes, token_text
from llmserve.tokenizer import apply_chat_template


def _top(raw: bytes, logprob: float) -> dict:
    return {"token": token_text(raw), "logprob": max(logprob, LOGPROB_FLOOR),
            "bytes": list(raw)}


def chat_logprobs(token_ids: list[int], entries: SampleLogprobs, num_top: int,
                  token_bytes: TokenBytes) -> ChatCompletionLogProbs:
    """OpenAI chat logprobs: per token its text, logprob, raw UTF-8 ``bytes`` and the
    ``num_top`` most likely alternatives (by rank). A token that holds part of a
    character has the bytes of that part, and a text with them as ``\\xNN`` escapes
    (``"\\xf0\\x9f"``), as OpenAI answers."""
    content = []
    for tid, entry in zip(token_ids, entries):
        sampled = entry.get(tid) or next(iter(entry.values()))
        tops = sorted(((t, e) for t, e in entry.items() if e.rank is not None
                       and e.rank <= num_top), key=lambda te: te[1].rank)
        content.append(ChatCompletionLogProbsContent(
            **_top(token_bytes(tid), sampled.logprob),
            top_logprobs=[TopLogprob(**_top(token_bytes(t), e.logprob)) for t, e in tops]))
    return ChatCompletionLogProbs(content=content)


# request fields the template already gets; chat_template_kwargs may not set them
RESERVED_TEMPLATE_VARS = ("messages", "tools", "documents", "add_generation_prompt",
                          "continue_final_message")


class OpenAIServingChat(OpenAIServing):
    """Handler of the chat endpoint (see :class:`OpenAIServing` for the args).

    Args:
        trust_request_chat_template: let requests replace the model's chat template
            (``chat_template``, or ``chat_template_kwargs.chat_template``), as vLLM's
            ``--trust-request-chat-template``; otherwise such a request is a 400.
    """

    def __init__(self, *args, trust_request_chat_template: bool = False,
                 tool_call_parser: str | None = "hermes", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if tool_call_parser is not None and tool_call_parser not in tool_parser_names():
            raise ValueError(f"tool_call_parser must be one of {tool_parser_names()}, got "
                             f"{tool_call_parser!r}")
        self.tool_call_parser = tool_call_parser  # reads tool_choice=auto outputs
        self.trust_request_chat_template = trust_request_chat_template
        self.template_limits = RenderLimits(
            max_chars=max(DEFAULT_MAX_RENDERED_CHARS, 32 * self.engine.max_model_len))

    def _template_args(self, req: ChatCompletionRequest) -> tuple[str | None, str, dict]:
        """(request template or None, the param its errors name, template variables).
        Raises APIError 400 for a template the operator did not allow or bad kwargs."""
        kwargs = dict(req.chat_template_kwargs or {})
        source, param = req.chat_template, "chat_template"
        if "chat_template" in kwargs:
            source, param = kwargs.pop("chat_template"), "chat_template_kwargs"
            if req.chat_template is not None:
                raise bad_request("send the chat template once: chat_template or "
                                  "chat_template_kwargs.chat_template", param)
        if source is not None:
            if not self.trust_request_chat_template:
                raise bad_request(
                    f"{param}: this server does not accept chat templates from requests "
                    f"(the operator allows them with --trust-request-chat-template)", param)
            if not isinstance(source, str) or not source:
                raise bad_request(f"{param}: the chat template must be a non-empty string",
                                  param)
        for key in RESERVED_TEMPLATE_VARS:
            if key in kwargs:
                raise bad_request(f"chat_template_kwargs.{key} is not allowed: set the request "
                                  f"field {key} instead", "chat_template_kwargs")
        try:
            kwargs = plain_value(kwargs, "chat_template_kwargs")
        except ValueError as e:
            raise bad_request(str(e), "chat_template_kwargs") from None
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        return source, param, kwargs

    def render(self, req: ChatCompletionRequest) -> list[int]:
        """Chat template -> prompt token ids (CPU work: call it off the event loop, see
        :meth:`render_prompt`). Raises APIError 400 for bad messages, a refused or
        failing template, or template variables that are not plain JSON values."""
        source, param, kwargs = self._template_args(req)
        template_text = source if source is not None else str(
            getattr(self.tokenizer, "chat_template", "") or "")
        messages = prepare_messages(req.messages, req.tools, "tools" in template_text)
        try:
            return apply_chat_template(self.tokenizer, messages,
                                       add_generation_prompt=req.add_generation_prompt,
                                       tools=req.tools, chat_template=source,
                                       limits=self.template_limits, **kwargs)
        except ChatTemplateError as e:
            raise bad_request(str(e), param if source is not None else "messages") from None
        except ValueError as e:
            raise bad_request(str(e), "messages") from None

    async def render_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """:meth:`render` in a worker thread, so a slow template (up to its time limit)
        does not stall the other requests."""
        return await asyncio.to_thread(self.render, req)

    async def create_chat_completion(self, req: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        """Raises APIError (400, 404, 503) before any output is sent."""
        model = self.model_name(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                              f"{req.top_logprobs}", "top_logprobs")
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        mode, fn_name = validate_tools(req.tools, req.tool_choice)
        parallel = req.parallel_tool_calls is not False
        structured = constrained_output(req.tools or [], mode, fn_name, parallel)
        if structured is not None and (req.response_format is not None and
                                       req.response_format.type != "text"
                                       or req.guided_json or req.guided_regex
                                       or req.guided_choice or req.guided_grammar):
            raise bad_request("tool_choice required or a named function cannot be combined "
                              "with another structured-output constraint", "tool_choice")
        parser = output_parser(mode, fn_name, self.tool_call_parser)
        max_calls = None if parallel else 1
        self.check_capacity(req.n)
        prompt_ids = await self.render_prompt(req)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = (req.max_completion_tokens if req.max_completion_tokens is not None
                     else req.max_tokens)
        params = self.sampling_params(req, self.check_length(len(prompt_ids), requested, field),
                                      num_top, structured=structured)
        request_id = random_id("chatcmpl")
        prompt = PromptInput(prompt_ids, cache_salt=req.cache_salt,
                             lora_request=self.lora_request_for(model))
        streams = await self.start(request_id, [(prompt, params)], req.n, req.priority)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._stream(request_id, model, created, streams, len(prompt_ids), num_top,
                             include_usage, parser, max_calls,
                             bool(req.stream_options and
                                  req.stream_options.continuous_usage_stats)),
                media_type="text/event-stream")
        try:
            finals = await until_disconnect(raw_request, collect(streams))
        except asyncio.CancelledError:
            return Response(status_code=499)
        finally:
            for s in streams:
                s.abort()
        choices = []
        num_generated = 0
        for i, out in enumerate(finals):
            c = out.outputs[0]
            num_generated += len(c.token_ids)
            logprobs = None
            if num_top is not None and c.logprobs is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs, num_top, self.token_bytes)
            content, calls = c.text, []
            if parser is not None:
                content, calls = parser.extract(c.text)
                calls = calls[:max_calls]
            choices.append(ChatCompletionResponseChoice(
                index=i, message=ChatMessage(content=content, tool_calls=[
                    ToolCall(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments))
                    for t in calls] or None), logprobs=logprobs,
                finish_reason=_finish_reason(c.finish_reason, bool(calls)),
                stop_reason=c.stop_reason))
        num_prompt = len(prompt_ids)
        resp = ChatCompletionResponse(
            id=request_id, created=created, model=model, choices=choices,
            usage=usage_info(num_prompt, num_generated, finals[0].num_cached_tokens),
            prompt_logprobs=(prompt_logprobs_json(finals[0].prompt_logprobs)
                             if req.prompt_logprobs is not None else None))
        return Response(resp.model_dump_json(), media_type="application/json")

    async def _stream(self, request_id: str, model: str, created: int,
                      streams: list[RequestStream], num_prompt: int, num_top: int | None,
                      include_usage: bool, parser: ToolParser | None = None,
                      max_calls: int | None = None, continuous_usage: bool = False
                      ) -> AsyncIterator[str]:
        def chunk(choices: list[ChatCompletionStreamChoice], usage=None) -> str:
            if continuous_usage and include_usage and usage is None and choices:
                usage = usage_info(num_prompt, num_generated, cached)
            return sse(ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=choices,
                usage=usage).model_dump_json())

        num_generated = 0
        cached = 0
        tool_streams = [StreamingToolCalls(parser, max_calls) if parser is not None else None
                        for _ in streams]
        num_calls = [0] * len(streams)
        try:
            for i in range(len(streams)):  # OpenAI: the role first, with empty content
                yield chunk([ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content=""))])
            async for i, out in iterate_streams(streams):
                c = out.outputs[0]
                num_generated += len(c.token_ids)
                if i == 0:
                    cached = max(cached, out.num_cached_tokens)
                logprobs = None
                if num_top is not None and c.logprobs:
                    logprobs = chat_logprobs(c.token_ids, c.logprobs, num_top, self.token_bytes)
                text, calls = c.text, []
                ts = tool_streams[i]
                if ts is not None:
                    text, calls = ts.feed(c.text)
                    if c.finish_reason is not None:
                        more_text, more_calls = ts.finish()
                        text, calls = text + more_text, calls + more_calls
                if not text and not calls and logprobs is None and c.finish_reason is None:
                    continue  # held back (stop-string buffer, unfinished character, tool call)
                deltas = None
                if calls:
                    deltas = [_delta_call(num_calls[i] + k, t) for k, t in enumerate(calls)]
                    num_calls[i] += len(calls)
                finish = c.finish_reason
                if finish is not None:
                    finish = _finish_reason(finish, num_calls[i] > 0)
                yield chunk([ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(content=text or None, tool_calls=deltas),
                    logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason)])
            if include_usage:
                yield chunk([], usage_info(num_prompt, num_generated, cached))
        except Exception as e:  # the 200 header is out: report in-band, as vLLM does
            yield sse_error(e)
        finally:
            for s in streams:
                s.abort()
        yield "data: [DONE]\n\n"


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI: ``tool_calls`` when the model called tools and stopped on its own."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def _delta_call(index: int, call: ParsedToolCall) -> DeltaToolCall:
    return DeltaToolCall(index=index, id=call.id, type="function",
                         function=DeltaFunctionCall(name=call.name, arguments=call.arguments))

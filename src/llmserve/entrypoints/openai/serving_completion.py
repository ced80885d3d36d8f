"""``POST /v1/completions`` (OpenAI API reference, "Completions"; vLLM's
``serving_completion.py``): prompts as strings or token ids, ``n``, ``echo``,
legacy ``logprobs``, and server-sent-event streaming ending in ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llmserve.engine.async_llm import RequestStream
from llmserve.entrypoints.openai.serving_engine import (
    LOGPROB_FLOOR,
    MAX_N,
    APIError,
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
from llmserve.outputs import Logprob, SampleLogprobs
from llmserve.protocol.openai import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    usage_info,
)
from llmserve.token_bytes import TokenBytes, incomplete_utf8_suffix_length, token_text
from llmserve.tokenizer import decode_ids, encode_text


def completion_logprobs(token_ids: list[int], entries: SampleLogprobs, num_top: int,
                        offset: int, token_bytes: TokenBytes, pending: bytes = b""
                        ) -> tuple[CompletionLogProbs, int, bytes]:
    """Legacy logprobs (OpenAI completions): ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (the sampled token and the ``num_top`` most likely, by text),
    ``text_offset`` (character offset of each token, starting at ``offset``).

    A token that is not whole UTF-8 by itself (part of a character) is written as
    OpenAI writes it, ``"bytes:\\xf0\\x9f"``; a character split over tokens counts in
    ``text_offset`` once it is complete. ``pending`` carries the bytes of such an
    unfinished character from one call (stream chunk) to the next.

    Returns:
        The logprobs object, the offset after the last token, the pending bytes.
    """
    def text_of(tid: int) -> str:
        raw = token_bytes(tid)
        text = token_text(raw)
        return text if text.encode("utf-8") == raw else "bytes:" + text

    lp = CompletionLogProbs()
    for tid, entry in zip(token_ids, entries):
        sampled = entry.get(tid) or next(iter(entry.values()))
        lp.tokens.append(text_of(tid))
        lp.token_logprobs.append(max(sampled.logprob, LOGPROB_FLOOR))
        lp.top_logprobs.append({
            text_of(t): max(e.logprob, LOGPROB_FLOOR)
            for t, e in entry.items() if t == tid or (e.rank is not None and e.rank <= num_top)})
        lp.text_offset.append(offset)
        pending += token_bytes(tid)
        keep = incomplete_utf8_suffix_length(pending)
        offset += len(pending[:len(pending) - keep].decode("utf-8", errors="replace"))
        pending = pending[len(pending) - keep:]
    return lp, offset, pending


def echo_logprobs(prompt_ids: list[int], entries: list | None, num_top: int,
                  token_bytes: TokenBytes) -> tuple[CompletionLogProbs, int, bytes]:
    """Legacy logprobs of the prompt (``echo`` with ``logprobs``, as OpenAI's legacy
    completions and lm-eval's loglikelihood expect): the first token has
    ``token_logprobs`` and ``top_logprobs`` None. Returns what
    :func:`completion_logprobs` returns, to continue with the generated tokens.

    Raises:
        APIError 500 when the engine has no prompt logprobs for the request.
    """
    if entries is None or len(entries) != len(prompt_ids):
        raise APIError(500, "prompt logprobs are missing for this request", "server_error")
    first = {prompt_ids[0]: Logprob(0.0, 1)}
    lp, offset, pending = completion_logprobs(prompt_ids, [first, *entries[1:]], num_top, 0,
                                              token_bytes)
    lp.token_logprobs[0] = None
    lp.top_logprobs[0] = None
    return lp, offset, pending


class OpenAIServingCompletion(OpenAIServing):
    """Handler of the completions endpoint (see :class:`OpenAIServing` for the args)."""

    def _prompts(self, prompt: str | list) -> list[PromptInput]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise bad_request("prompt must not be empty", "prompt")
                try:
                    out.append(PromptInput(encode_text(self.tokenizer, p), p))
                except ValueError as e:
                    raise bad_request(str(e), "prompt") from None
            else:
                if not p:
                    raise bad_request("prompt token id lists must not be empty", "prompt")
                out.append(PromptInput(list(p)))
        return out

    async def _prompt_text(self, prompt: PromptInput) -> str:
        if prompt.text is None:
            prompt.text = await self.run_tokenizer(decode_ids, self.tokenizer, prompt.token_ids)
        return prompt.text

    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Response:
        """Raises APIError (400, 404, 503) before any output is sent."""
        model = self.model_name(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        best_of = req.best_of if req.best_of is not None else req.n
        if not req.n <= best_of <= MAX_N:
            raise bad_request(f"best_of must be in [n ({req.n}), {MAX_N}], got {best_of}",
                              "best_of")
        if best_of > req.n and req.stream:
            raise bad_request("best_of > n cannot be streamed (OpenAI); drop stream or best_of",
                              "best_of")
        echo_only = req.max_tokens == 0  # score the prompt, generate nothing (lm-eval)
        if echo_only and not req.echo:
            raise bad_request("max_tokens must be >= 1 (0 only with echo=true)", "max_tokens")
        max_tokens = 1 if echo_only else req.max_tokens
        echo_lp = req.logprobs if req.echo else None  # echo + logprobs: prompt logprobs
        if echo_lp is not None and req.prompt_logprobs is not None:
            echo_lp = max(echo_lp, req.prompt_logprobs)
        single = isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int))
        self.check_capacity(best_of * (1 if single else max(len(req.prompt), 1)))
        prompts = await self.run_tokenizer(self._prompts, req.prompt)
        lora = self.lora_request_for(model)
        for p in prompts:
            p.cache_salt = req.cache_salt
            p.lora_request = lora
        # best_of ranks candidates by cumulative logprob, which needs logprobs
        logprobs = req.logprobs if req.logprobs is not None or best_of == req.n else 0
        jobs = [(p, self.sampling_params(req, self.check_length(len(p.token_ids), max_tokens),
                                         logprobs, echo_lp)) for p in prompts]
        request_id = random_id("cmpl")
        streams = await self.start(request_id, jobs, best_of, req.priority)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._stream(req, request_id, model, created, streams, prompts, include_usage,
                             echo_only),
                media_type="text/event-stream")
        try:
            finals = await until_disconnect(raw_request, collect(streams))
        except asyncio.CancelledError:
            return Response(status_code=499)
        finally:
            for s in streams:
                s.abort()
        num_generated = sum(len(out.outputs[0].token_ids) for out in finals)
        cached = sum(out.num_cached_tokens for out in finals[::best_of])  # once per prompt
        if best_of > req.n:  # OpenAI best_of: the n of best_of with the highest logprob
            finals = [out for p in range(len(prompts)) for out in sorted(
                finals[p * best_of:(p + 1) * best_of],
                key=lambda o: -(o.outputs[0].cumulative_logprob or 0.0))[:req.n]]
        choices = []
        for i, out in enumerate(finals):
            c = out.outputs[0]
            prompt = prompts[i // req.n]
            gen_ids, gen_lps, text = c.token_ids, c.logprobs, c.text
            if echo_only:
                gen_ids, gen_lps, text = [], [], ""
            prefix = await self._prompt_text(prompt) if req.echo else ""
            logprobs = None
            if req.logprobs is not None and gen_lps is not None:
                offset, pending = 0, b""
                if req.echo:
                    logprobs, offset, pending = echo_logprobs(
                        prompt.token_ids, out.prompt_logprobs, req.logprobs, self.token_bytes)
                gen, _, _ = completion_logprobs(gen_ids, gen_lps, req.logprobs, offset,
                                                self.token_bytes, pending)
                logprobs = gen if logprobs is None else _concat(logprobs, gen)
            choices.append(CompletionResponseChoice(
                index=i, text=prefix + text, logprobs=logprobs,
                finish_reason="length" if echo_only else c.finish_reason,
                stop_reason=None if echo_only else c.stop_reason,
                prompt_logprobs=(prompt_logprobs_json(out.prompt_logprobs)
                                 if req.prompt_logprobs is not None else None)))
        if echo_only:
            num_generated = 0
        num_prompt = sum(len(p.token_ids) for p in prompts)
        resp = CompletionResponse(
            id=request_id, created=created, model=model, choices=choices,
            usage=usage_info(num_prompt, num_generated, cached))
        return Response(resp.model_dump_json(), media_type="application/json")

    async def _stream(self, req: CompletionRequest, request_id: str, model: str, created: int,
                      streams: list[RequestStream], prompts: list[PromptInput],
                      include_usage: bool, echo_only: bool = False) -> AsyncIterator[str]:
        n = req.n
        echoed = [False] * len(streams)
        offsets = [0] * len(streams)
        pending = [b""] * len(streams)  # bytes of a character split over tokens
        num_generated = 0
        cached = [0] * len(prompts)
        try:
            async for i, out in iterate_streams(streams):
                c = out.outputs[0]
                gen_ids, gen_lps, text = c.token_ids, c.logprobs, c.text
                if echo_only:
                    gen_ids, gen_lps, text = [], [], ""
                num_generated += len(gen_ids)
                if i % n == 0:
                    cached[i // n] = max(cached[i // n], out.num_cached_tokens)
                logprobs = None
                plp = None
                if req.echo and not echoed[i]:
                    echoed[i] = True
                    text = await self._prompt_text(prompts[i // n]) + text
                    if req.logprobs is not None:
                        logprobs, offsets[i], pending[i] = echo_logprobs(
                            prompts[i // n].token_ids, out.prompt_logprobs, req.logprobs,
                            self.token_bytes)
                if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
                    plp = prompt_logprobs_json(out.prompt_logprobs)
                if req.logprobs is not None and gen_lps:
                    gen, offsets[i], pending[i] = completion_logprobs(
                        gen_ids, gen_lps, req.logprobs, offsets[i], self.token_bytes,
                        pending[i])
                    logprobs = gen if logprobs is None else _concat(logprobs, gen)
                if not text and logprobs is None and c.finish_reason is None:
                    continue  # held back (stop-string buffer or an unfinished character)
                usage = None
                if include_usage and req.stream_options.continuous_usage_stats:
                    usage = usage_info(sum(len(p.token_ids) for p in prompts), num_generated,
                                       sum(cached))
                chunk = CompletionStreamResponse(
                    id=request_id, created=created, model=model, usage=usage, choices=[
                        CompletionResponseChoice(
                            index=i, text=text, logprobs=logprobs,
                            finish_reason=("length" if echo_only and c.finish_reason
                                           else c.finish_reason),
                            stop_reason=None if echo_only else c.stop_reason,
                            prompt_logprobs=plp)])
                yield sse(chunk.model_dump_json())
            if include_usage:
                num_prompt = sum(len(p.token_ids) for p in prompts)
                usage = usage_info(num_prompt, num_generated, sum(cached))
                yield sse(CompletionStreamResponse(id=request_id, created=created, model=model,
                                                   choices=[], usage=usage).model_dump_json())
        except Exception as e:  # the 200 header is out: report in-band, as vLLM does
            yield sse_error(e)
        finally:
            for s in streams:
                s.abort()
        yield "data: [DONE]\n\n"


def _concat(a: CompletionLogProbs, b: CompletionLogProbs) -> CompletionLogProbs:
    """The prompt's legacy logprobs followed by the generated tokens'."""
    return CompletionLogProbs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens,
                              top_logprobs=a.top_logprobs + b.top_logprobs)

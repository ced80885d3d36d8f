"""Request and response models of the OpenAI-compatible API.

Sources: the OpenAI API reference (https://platform.openai.com/docs/api-reference:
completions, chat, models, errors) and vLLM's ``vllm/entrypoints/openai/protocol.py``
for the extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, skip_special_tokens, stop_token_ids, include_stop_str_in_output,
priority) and for ``/tokenize`` and ``/detokenize``.

Requests ignore unknown fields (clients send extra ones) but check types strictly:
``"temperature": "hot"`` or ``"stream": 1`` is a 400, not a silent coercion.
Ranges are checked later by :class:`~llmserve.sampling_params.SamplingParams` (whose
messages name the field); the published schema (``/openapi.json``) states the same
ranges through ``json_schema_extra`` (:func:`_doc`), so a body the schema allows is not
refused for its shape.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


def _doc(default: Any = None, **schema: Any) -> Any:
    """A field whose JSON schema also states ``schema`` (e.g. ``minimum``); the check
    itself is done by the handlers, whose messages are clearer than pydantic's."""
    return Field(default, json_schema_extra=schema)


def _set_schema(schema: dict[str, Any]) -> Any:
    """A field whose JSON schema is ``schema`` (for shapes pydantic cannot state)."""
    def replace(s: dict[str, Any]) -> None:
        title = s.get("title")
        s.clear()
        s.update(schema, **({"title": title} if title else {}))
    return replace


_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
    {"type": "array", "minItems": 1,
     "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}},
]}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"enum": ["text", "input_text"]},
                             "text": {"type": "string"}}}
_MESSAGES_SCHEMA = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART},
                              {"type": "null"}]}}}}
_JSON_VALUE_DOC = ("extra template variables: JSON values; `chat_template` only with "
                   "--trust-request-chat-template")


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------- errors
class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(ResponseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---------------------------------------------------------------------- requests
class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk (needs include_usage)


class JsonSchemaFormat(RequestModel):
    """``response_format.json_schema`` (OpenAI structured outputs)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(RequestModel):
    """Fields shared by completions and chat (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    temperature: float | None = _doc(minimum=0)  # default 1.0
    top_p: float | None = _doc(exclusiveMinimum=0, maximum=1)  # default 1.0
    n: int = _doc(1, minimum=1, maximum=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, json_schema_extra=_set_schema({"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string", "minLength": 1}},
        {"type": "null"}]}))
    seed: int | None = _doc(minimum=-(2**63), maximum=2**64 - 1)
    presence_penalty: float | None = _doc(minimum=-2, maximum=2)
    frequency_penalty: float | None = _doc(minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> [-100, 100]
    user: str | None = None
    service_tier: str | None = None  # accepted, as OpenAI's; one tier here
    metadata: dict[str, str] | None = None  # accepted and ignored (OpenAI stores it)
    response_format: ResponseFormat | None = None
    # vLLM extras: structured outputs (one of them, or response_format)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # EBNF (``root ::= ...``) or Lark (``start: ...``)
    structured_outputs: dict[str, Any] | None = None  # {"json"|"regex"|"choice"|"grammar"}
    # vLLM extras
    top_k: int | None = _doc(minimum=-1)
    min_p: float | None = _doc(minimum=0, maximum=1)
    repetition_penalty: float | None = _doc(exclusiveMinimum=0)
    ignore_eos: bool = False
    min_tokens: int = _doc(0, minimum=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_token_ids: list[int] | None = Field(None, json_schema_extra=_set_schema({"anyOf": [
        {"type": "array", "items": {"type": "integer", "minimum": 0}}, {"type": "null"}]}))
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = _doc(minLength=1)  # requests with other salts share no cache
    prompt_logprobs: int | None = _doc(minimum=0, maximum=20)  # vLLM: top-k per prompt token
    # llmserve extras: this request's KV eviction (kv_cache/eviction; engine defaults: None)
    kv_eviction_policy: str | None = None  # none | streaming_llm | h2o | snapkv
    kv_budget_tokens: int | None = _doc(minimum=1)
    num_sink_tokens: int | None = _doc(minimum=0)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of
    token ids, or a list of lists of token ids (one choice per prompt and ``n``)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        json_schema_extra=_set_schema(_PROMPT_SCHEMA))
    # OpenAI's default for completions; 0 only with echo (the prompt, scored: lm-eval)
    max_tokens: int | None = _doc(16, minimum=0)
    logprobs: int | None = _doc(minimum=0, maximum=20)  # legacy: top logprobs per token
    echo: bool = False  # with logprobs: the prompt tokens' logprobs come first
    suffix: str | None = _doc(maxLength=0)  # not supported: 400 when set
    best_of: int | None = None  # only None or == n


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. ``messages`` are checked by
    :func:`llmserve.tokenizer.validate_messages` (roles; string or text-part content)."""

    messages: list[dict[str, Any]] = Field(json_schema_extra=_set_schema(_MESSAGES_SCHEMA))
    max_tokens: int | None = _doc(minimum=1)  # deprecated by OpenAI: max_completion_tokens
    max_completion_tokens: int | None = _doc(minimum=1)
    logprobs: bool = False
    top_logprobs: int | None = _doc(minimum=0, maximum=20)  # needs logprobs=true
    tools: list[dict[str, Any]] | None = None  # handed to the chat template
    tool_choice: str | dict[str, Any] | None = None  # none / auto / required / a function
    parallel_tool_calls: bool | None = None  # default true
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # needs add_generation_prompt=false
    chat_template: str | None = _doc(minLength=1, description=(
        "a Jinja chat template to use instead of the model's; only with "
        "--trust-request-chat-template"))
    chat_template_kwargs: dict[str, Any] | None = _doc(description=_JSON_VALUE_DOC)


class TokenizeRequest(RequestModel):
    """vLLM's ``POST /tokenize``: either ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------- responses
class PromptTokensDetails(ResponseModel):
    """``cached_tokens``: prompt tokens served from the prefix cache (OpenAI's field)."""

    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def usage_info(num_prompt: int, num_generated: int, cached: int) -> UsageInfo:
    """OpenAI usage; ``prompt_tokens_details.cached_tokens`` counts prefix-cache hits."""
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                     total_tokens=num_prompt + num_generated,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class CompletionLogProbs(ResponseModel):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    """vLLM's prompt-logprob value: one token's logprob, 1-based rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM extra ``prompt_logprobs``: per prompt token (the first None) token id -> PromptLogprob
PromptLogprobsField = list[dict[str, PromptLogprob] | None] | None


class CompletionResponseChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extra: the stop string or token id
    prompt_logprobs: PromptLogprobsField = None  # vLLM extra (request prompt_logprobs)


def _now() -> int:
    return int(time.time())


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(ResponseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    """A streamed tool call: the first delta of call ``index`` carries its id, type and
    name; ``arguments`` pieces concatenate (OpenAI's chunk format)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(ResponseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionResponseChoice(ResponseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsField = None  # vLLM extra (request prompt_logprobs)


class DeltaMessage(ResponseModel):
    """A streamed piece of the assistant message; unset fields are left out."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="plain")
    def _drop_none(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in (("role", self.role), ("content", self.content))
                               if v is not None}
        if self.tool_calls is not None:
            out["tool_calls"] = [t.model_dump(exclude_none=True) for t in self.tool_calls]
        return out


class ChatCompletionStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "llmserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM)
    max_model_len: int | None = None
    lora_int_id: int | None = None  # an adapter's prefix-cache salt (the router hashes with it)


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str


class TokenizerInfoResponse(ResponseModel):
    """vLLM's ``GET /tokenizer_info`` (what lm-eval's remote tokenizer reads)."""

    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    model_max_length: int


class VersionResponse(ResponseModel):
    version: str

"""Per-request sampling parameters (pure Python, no torch).

Semantics follow vLLM's ``SamplingParams`` and the OpenAI API reference
(https://platform.openai.com/docs/api-reference/completions/create):

- ``temperature`` 0 (anything below ``SAMPLING_EPS``) means greedy decoding;
  ``top_p``, ``top_k`` and ``min_p`` are then reset to their neutral values.
- ``presence_penalty`` / ``frequency_penalty`` are OpenAI's additive penalties
  over generated tokens; ``repetition_penalty`` is the multiplicative CTRL
  penalty (Keskar et al. 2019, https://arxiv.org/abs/1909.05858) over prompt
  and generated tokens.

Every invalid value raises ``ValueError`` whose message names the field and
says what is allowed, so the API layer can turn it into a 400 response.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

SAMPLING_EPS = 1e-5
"""Temperatures below this are treated as greedy (argmax) decoding."""

MAX_LOGPROBS = 20
"""Largest number of top log-probabilities a request may ask for (OpenAI's limit)."""

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # the range torch.Generator.manual_seed accepts


class SamplingType(IntEnum):
    """How a request picks its next token."""

    GREEDY = 0  # argmax
    RANDOM = 1  # sample with the engine's shared random generator
    RANDOM_SEED = 2  # sample with the request's own seeded generator


def _check_int(name: str, value: Any, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        allowed = "an int or None" if allow_none else "an int"
        raise ValueError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}")
    return int(value)


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _normalize_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"stop must be a string, a list of strings or None, got {type(value).__name__} {value!r}")
    for s in value:
        if not isinstance(s, str):
            raise ValueError(f"stop must contain only strings, got {type(s).__name__} {s!r}")
        if not s:
            raise ValueError("stop must contain only non-empty strings, got ''")
    return list(value)


def _normalize_stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"stop_token_ids must be a list of ints or None, got {type(value).__name__} {value!r}")
    out = []
    for t in value:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"stop_token_ids must contain only ints, got {type(t).__name__} {t!r}")
        if t < 0:
            raise ValueError(f"stop_token_ids must contain only ids >= 0, got {t}")
        out.append(int(t))
    return out


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's ``StructuredOutputsParams``); set one of:

    Attributes:
        json: a JSON schema (dict or JSON text): the output is one JSON value valid
            against it (OpenAI ``response_format`` ``json_schema``, vLLM ``guided_json``).
        json_object: any JSON object (OpenAI ``response_format`` ``json_object``).
        regex: the output matches this regular expression in full (``guided_regex``).
        choice: the output is exactly one of these strings (``guided_choice``).
        grammar: an EBNF (GBNF, xgrammar's dialect: ``root ::= ...``) or a Lark grammar
            (``start: ...``) (``guided_grammar``).

    Compiled by :mod:`llmserve.structured_output` (cached per spec); ``compiled`` is
    attached there and shared, never copied, by :meth:`SamplingParams.clone`.

    Raises:
        ValueError: when none or several are set, or one has the wrong type.
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("structured_outputs: set exactly one of json, json_object, regex, "
                             f"choice, grammar; got {set_ or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (object or text)")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (
                not isinstance(self.choice, (list, tuple)) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of "
                             "non-empty strings")
        self.compiled: Any = None

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def __deepcopy__(self, memo: dict) -> StructuredOutputsParams:
        return self  # immutable once built; the compiled grammar is shared


@dataclass
class SamplingParams:
    """Sampling parameters of one request (vLLM / OpenAI semantics).

    Attributes:
        n: number of completions to return for the prompt (>= 1; must be 1
            when greedy, as in vLLM, since greedy completions are identical).
        temperature: softmax temperature (>= 0). Below ``SAMPLING_EPS``
            (e.g. 0) decoding is greedy and top_p/top_k/min_p are reset.
        top_p: nucleus sampling; keep the smallest set of most likely tokens
            whose probability mass reaches ``top_p`` (0 < top_p <= 1).
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 disable
            (normalized to 0); otherwise >= 1.
        min_p: drop tokens whose probability is below ``min_p`` times the
            most likely token's probability ([0, 1]; 0 disables).
        seed: seed of the request's own random generator, making its sampled
            tokens reproducible regardless of batching; None for the shared one.
        presence_penalty: subtracted once from the logit of every token
            already generated ([-2, 2], OpenAI).
        frequency_penalty: subtracted from a token's logit once per time it
            was generated ([-2, 2], OpenAI).
        repetition_penalty: CTRL penalty on tokens in the prompt or output:
            positive logits are divided by it, others multiplied (> 0;
            1 disables; > 1 discourages repetition).
        max_tokens: most tokens to generate (>= 1); None means up to the
            model's context length.
        min_tokens: EOS and ``stop_token_ids`` are blocked until this many
            tokens were generated (>= 0, <= max_tokens).
        stop: strings that end generation (normalized to a list of
            non-empty strings); not included in the output unless
            ``include_stop_str_in_output``.
        stop_token_ids: token ids that end generation (normalized to a list
            of ints >= 0).
        ignore_eos: keep generating after the EOS token.
        logprobs: number of most likely tokens whose log-probabilities are
            returned per generated token, besides the sampled token
            (0..MAX_LOGPROBS); None returns none.
        prompt_logprobs: number of most likely tokens whose log-probabilities are
            returned per prompt position, besides the prompt token itself
            (0..MAX_LOGPROBS); None returns none. Computed in the prefill's own
            forward pass; such a request does not read the prefix cache (its
            cached part would have no logits), as vLLM v1.
        structured_outputs: a :class:`StructuredOutputsParams` the output must follow
            (a token mask applied in the sampler), or None.
        logit_bias: token id -> bias added to its logit before sampling
            (OpenAI: [-100, 100]; -100 bans, 100 forces in practice), or None.
        skip_special_tokens: drop special tokens when detokenizing.
        spaces_between_special_tokens: put spaces between special tokens
            when detokenizing.
        include_stop_str_in_output: keep the matched stop string in the text.
        kv_eviction_policy, kv_budget_tokens, num_sink_tokens: this request's KV
            eviction (``none``, ``streaming_llm``, ``h2o``, ``snapkv``; budget in tokens;
            StreamingLLM's sinks), overriding the engine's ``--kv-eviction-policy``,
            ``--kv-budget-tokens``, ``--num-sink-tokens``; None: the engine's.

    Raises:
        ValueError: on a value of the wrong type or out of range; the message
            names the field and what is allowed.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    kv_eviction_policy: str | None = None
    kv_budget_tokens: int | None = None
    num_sink_tokens: int | None = None

    def __post_init__(self) -> None:
        self._check_types()
        self._check_ranges()
        self._check_extras()
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < SAMPLING_EPS:
            # Greedy: the filters cannot change the argmax, reset them to neutral.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_types(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            setattr(self, name, _check_int(name, getattr(self, name)))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "kv_budget_tokens",
                     "num_sink_tokens"):
            setattr(self, name, _check_int(name, getattr(self, name), allow_none=True))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            setattr(self, name, _check_float(name, getattr(self, name)))
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))

    def _check_extras(self) -> None:
        if self.kv_eviction_policy is not None and not isinstance(self.kv_eviction_policy, str):
            raise ValueError("kv_eviction_policy must be a string (none, streaming_llm, h2o, "
                             "snapkv) or None")
        if self.kv_budget_tokens is not None and self.kv_budget_tokens <= 0:
            raise ValueError(f"kv_budget_tokens must be > 0, got {self.kv_budget_tokens}")
        if self.num_sink_tokens is not None and self.num_sink_tokens < 0:
            raise ValueError(f"num_sink_tokens must be >= 0, got {self.num_sink_tokens}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be a dict of token id -> bias")
        bias = {}
        for k, v in self.logit_bias.items():
            tid = _check_int("logit_bias key", k)
            if tid < 0:
                raise ValueError(f"logit_bias: {tid} is not a token id")
            v = _check_float("logit_bias value", v)
            if not -100.0 <= v <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {v}")
            bias[tid] = v
        self.logit_bias = bias or None

    def _check_ranges(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] or None, "
                             f"got {self.prompt_logprobs}")

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY when temperature < SAMPLING_EPS, else RANDOM_SEED with a seed, else RANDOM."""
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def clone(self) -> SamplingParams:
        """Return a deep copy (the stop lists are not shared with this one)."""
        return copy.deepcopy(self)

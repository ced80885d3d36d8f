"""SpeculativeConfig: validated, frozen speculative-decoding options (pure Python).

Field names follow vLLM's ``SpeculativeConfig`` (``--speculative-config '{json}'``):
``method`` (``"ngram"`` | ``"draft_model"``), ``model``, ``num_speculative_tokens``,
``prompt_lookup_min`` / ``prompt_lookup_max`` (n-gram prompt lookup) and
``quantization`` (of the draft). Three fields are ours: ``draft_length_policy``
(``"fixed"``: always ``num_speculative_tokens``; ``"adaptive"``: per request, from
its recent acceptance rate and the batch size), ``disable_by_batch_size``
(vLLM v0's ``speculative_disable_by_batch_size``: no drafts while more requests run)
and ``draft_vocab_size`` (the draft scores only ids ``[0, N)``, FR-Spec's reduced
draft vocabulary, SGLang's ``--speculative-token-map``; see ``draft_vocab.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "draft_model")
DRAFT_LENGTH_POLICIES = ("fixed", "adaptive")
MAX_SPECULATIVE_TOKENS = 32


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings.

    ``method``: ``"ngram"`` (prompt lookup: the tokens that followed the latest
    earlier occurrence of the context's last n-gram, ``prompt_lookup_min <= n <=
    prompt_lookup_max``, longest n first) or ``"draft_model"`` (a smaller model with
    the target's tokenizer, ``model`` = its path or name). None with ``model`` set
    means ``"draft_model"``; ``model="ngram"`` means ``"ngram"`` (vLLM's spelling).
    ``num_speculative_tokens``: drafted tokens per step, ``k`` (the most, when adaptive).
    ``prompt_lookup_min`` / ``prompt_lookup_max``: default 5 / 5; one given sets the
    other (vLLM's defaults).

    Raises:
        ValueError: naming the field, for any invalid value.
    """

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_length_policy: str = "fixed"
    disable_by_batch_size: int | None = None
    quantization: str = "auto"
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        method = self.method
        if method is None:
            if self.model is None:
                raise ValueError("speculative_config.method is required: one of "
                                 f"{list(SPEC_METHODS)} (or give a draft 'model')")
            method = "ngram" if self.model in ("ngram", "[ngram]") else "draft_model"
        if method == "[ngram]":
            method = "ngram"
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(SPEC_METHODS)}, "
                             f"got {method!r}")
        object.__setattr__(self, "method", method)
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be <= "
                             f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        if method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = 5
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            _positive_int("prompt_lookup_min", lo)
            _positive_int("prompt_lookup_max", hi)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                                 f"prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if self.model not in (None, "ngram", "[ngram]"):
                raise ValueError("speculative_config.model is only for method 'draft_model', "
                                 f"got {self.model!r} with method 'ngram'")
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config.model (the draft model's path or name) is "
                             "required for method 'draft_model'")
        if self.draft_length_policy not in DRAFT_LENGTH_POLICIES:
            raise ValueError(f"speculative_config.draft_length_policy must be one of "
                             f"{list(DRAFT_LENGTH_POLICIES)}, got {self.draft_length_policy!r}")
        if self.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if self.draft_vocab_size is not None:
            _positive_int("draft_vocab_size", self.draft_vocab_size)
            if method != "draft_model":
                raise ValueError("speculative_config.draft_vocab_size is only for method "
                                 "'draft_model'")
        if not isinstance(self.quantization, str):
            raise ValueError(f"speculative_config.quantization must be a string, "
                             f"got {self.quantization!r}")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str | None
                   ) -> SpeculativeConfig | None:
        """Build from a dict, a JSON string (``--speculative-config``) or pass through.

        Raises:
            ValueError: for bad JSON, an unknown key or an invalid value.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object / dict, "
                             f"got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; "
                             f"allowed: {sorted(known)}")
        return cls(**value)

    @property
    def needs_draft_probs(self) -> bool:
        """Whether the proposer gives a draft distribution q (else q is one-hot)."""
        return self.method == "draft_model"

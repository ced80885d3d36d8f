"""Tiered model routing: one alias (e.g. ``model: "auto"``) over model tiers, small
to large, chosen per request by a complexity score.

A classifier scores a request body in [0, 1]; the first tier whose ``max_score`` is
>= the score answers, the last tier takes the rest. The router rewrites ``model`` to
the tier's model, routes among the workers that serve it, and says what it did in
the ``x-llmserve-tier`` (model), ``x-llmserve-complexity`` (score) and, after an
escalation, ``x-llmserve-escalated-from`` response headers. Escalation: when a
non-streamed answer of a tier ends with a finish reason in ``escalate_on`` (e.g.
``length``: the small model ran out of room), the request is sent again to the next
tier and that answer is returned. A stream cannot be escalated (its bytes are already
with the client), so streamed requests stay on their first tier.

Config (the ``tiers`` section of ``router.yaml``)::

    tiers:
      auto:                       # the alias clients send as "model"
        classifier: heuristic     # a registered name, or "package.module:Class"
        escalate_on: [length]     # finish reasons that retry on the next tier
        levels:
          - {model: smollm2-135m-instruct, max_score: 0.35}
          - {model: qwen2.5-coder-1.5b-instruct}   # the last level: no max_score

The ``heuristic`` classifier is a transparent weighted sum of features that the
routing literature uses as complexity signals (RouteLLM, Ong et al. 2024, route on
learned preference; we use features only, so it runs without a model): prompt
length, code, math and reasoning markers, and conversation depth. Replace it with a
learned one by registering a class (:func:`register_classifier`).

Errors: :class:`ValueError` naming the field.
"""

from __future__ import annotations

import abc
import importlib
import math
import re
from dataclasses import dataclass
from typing import Any

_CLASSIFIERS: dict[str, type[ComplexityClassifier]] = {}


class ComplexityClassifier(abc.ABC):
    """Scores a request body (an OpenAI completions or chat body) in [0, 1]:
    0 = trivial, 1 = as hard as requests get. Pure, fast (runs on every request)."""

    @abc.abstractmethod
    def score(self, body: dict[str, Any]) -> float: ...


def register_classifier(name: str):
    """Class decorator: make a :class:`ComplexityClassifier` available by ``name``."""
    def deco(cls):
        _CLASSIFIERS[name] = cls
        return cls
    return deco


def create_classifier(spec: str) -> ComplexityClassifier:
    """A classifier by registered name or ``package.module:Class``.

    Raises:
        ValueError: unknown name, unimportable path, or not a ComplexityClassifier.
    """
    if spec in _CLASSIFIERS:
        return _CLASSIFIERS[spec]()
    if ":" not in spec:
        raise ValueError(f"classifier: unknown {spec!r}; registered: {sorted(_CLASSIFIERS)}"
                         f" (or give package.module:Class)")
    mod, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"classifier: cannot load {spec!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, ComplexityClassifier)):
        raise ValueError(f"classifier: {spec!r} is not a ComplexityClassifier subclass")
    return cls()


def request_text(body: dict[str, Any]) -> tuple[str, int]:
    """All prompt text of a body (string prompts, message contents and text parts)
    and the number of messages (1 for a completions prompt)."""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        parts = []
        for m in msgs:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):
                parts += [p.get("text", "") for p in c if isinstance(p, dict)
                          and isinstance(p.get("text"), str)]
        return "\n".join(parts), len(msgs)
    p = body.get("prompt")
    if isinstance(p, str):
        return p, 1
    if isinstance(p, list):
        return "\n".join(x for x in p if isinstance(x, str)), 1
    return "", 1


_CODE = re.compile(r"```|\bdef \w+\(|\bclass \w+|\bfunction\b|\bimport \w+|#include|=>|"
                   r"\breturn\b|\bimplement|\brefactor|\bdebug|\bcompile|\bstack trace|"
                   r"\bSQL\b|\bregex|\bunit tests?\b|[{};]\s*\n", re.I)
_MATH = re.compile(r"\\frac|\\int|\\sum|\bprove\b|\btheorem\b|\blemma\b|\bequation|"
                   r"\bintegral|\bderivative|\bmatrix|\bprobability|\d+\s*[\^*/]\s*\d+", re.I)
_REASON = re.compile(r"step by step|\bexplain why\b|\banaly[sz]e|\bcompare\b|trade-?offs?|"
                     r"\bdesign\b|\barchitecture|\bjustify|\bpros and cons\b|\bplan\b", re.I)


@register_classifier("heuristic")
class HeuristicClassifier(ComplexityClassifier):
    """``0.3 length + 0.3 code + 0.15 math + 0.15 reasoning + 0.1 depth``, each feature
    in [0, 1]: length ``log2(1 + chars / 200) / 5`` (about 6,000 characters saturate),
    code ``hits / 3``, math and reasoning ``hits / 2`` (regex markers, capped at 1),
    depth ``(messages - 1) / 10``."""

    weights = {"length": 0.3, "code": 0.3, "math": 0.15, "reasoning": 0.15, "depth": 0.1}

    def features(self, body: dict[str, Any]) -> dict[str, float]:
        text, n_msgs = request_text(body)
        return {"length": min(1.0, math.log2(1 + len(text) / 200) / 5),
                "code": min(1.0, len(_CODE.findall(text)) / 3),
                "math": min(1.0, len(_MATH.findall(text)) / 2),
                "reasoning": min(1.0, len(_REASON.findall(text)) / 2),
                "depth": min(1.0, max(0, n_msgs - 1) / 10)}

    def score(self, body: dict[str, Any]) -> float:
        f = self.features(body)
        return round(min(1.0, sum(self.weights[k] * v for k, v in f.items())), 4)


@dataclass(frozen=True)
class TierLevel:
    model: str
    max_score: float | None = None  # None: the last level, takes every score


@dataclass(frozen=True)
class TierRoute:
    """One alias over ``levels`` (small to large)."""

    alias: str
    levels: tuple[TierLevel, ...]
    classifier: ComplexityClassifier
    escalate_on: tuple[str, ...] = ()

    def choose(self, body: dict[str, Any]) -> tuple[int, float]:
        """``(level index, score)`` for ``body``."""
        score = float(self.classifier.score(body))
        for i, lv in enumerate(self.levels):
            if lv.max_score is None or score <= lv.max_score:
                return i, score
        return len(self.levels) - 1, score


def parse_tiers(raw: Any, where: str = "tiers") -> dict[str, TierRoute]:
    """``alias -> TierRoute`` from the config's ``tiers`` mapping (see the module doc).

    Raises:
        ValueError: a field is missing or of the wrong type, ``max_score`` not in
            [0, 1] or not increasing, a non-last level without ``max_score``.
    """
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must map an alias to its tiers")
    out = {}
    for alias, spec in raw.items():
        w = f"{where}.{alias}"
        if not isinstance(spec, dict):
            raise ValueError(f"{w}: must be a mapping with 'levels'")
        unknown = set(spec) - {"levels", "classifier", "escalate_on"}
        if unknown:
            raise ValueError(f"{w}: unknown field(s) {sorted(unknown)}")
        levels = spec.get("levels")
        if not isinstance(levels, list) or len(levels) < 2:
            raise ValueError(f"{w}.levels: a list of at least two {{model, max_score}}")
        parsed, last = [], -1.0
        for i, lv in enumerate(levels):
            lw = f"{w}.levels[{i}]"
            if not isinstance(lv, dict) or not isinstance(lv.get("model"), str) \
                    or not lv["model"] or set(lv) - {"model", "max_score"}:
                raise ValueError(f"{lw}: must be {{model: NAME, max_score: 0..1}}")
            ms = lv.get("max_score")
            if i < len(levels) - 1:
                if isinstance(ms, bool) or not isinstance(ms, (int, float)) \
                        or not 0 <= ms <= 1 or ms <= last:
                    raise ValueError(f"{lw}.max_score: a number in [0, 1], larger than the "
                                     f"previous level's; got {ms!r}")
                last = float(ms)
            elif ms is not None:
                raise ValueError(f"{lw}.max_score: the last level takes every score; "
                                 f"leave it out")
            parsed.append(TierLevel(lv["model"], None if ms is None else float(ms)))
        esc = spec.get("escalate_on", [])
        if not isinstance(esc, list) or not all(isinstance(x, str) for x in esc):
            raise ValueError(f"{w}.escalate_on: a list of finish reasons, e.g. [length]")
        cls = spec.get("classifier", "heuristic")
        if not isinstance(cls, str):
            raise ValueError(f"{w}.classifier: a name or package.module:Class")
        try:
            classifier = create_classifier(cls)
        except ValueError as e:
            raise ValueError(f"{w}.{e}") from None
        out[str(alias)] = TierRoute(str(alias), tuple(parsed), classifier, tuple(esc))
    return out


def finish_reasons(body: bytes) -> list[str]:
    """The choices' ``finish_reason`` values of a non-streamed response ([] if none)."""
    import json

    try:
        data = json.loads(body)
        return [c.get("finish_reason") for c in data.get("choices") or []
                if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)]
    except (ValueError, AttributeError, TypeError):
        return []

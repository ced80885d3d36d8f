"""The content-safety check interface, its verdicts and the registry of checks by name.

A check looks at text and returns :class:`Verdict` s::

    InputCheck.check(text) -> [Verdict(check, category, action, spans, score, detail)]

* ``action`` comes from the team policy the check was built with: ``block``
  (reject the request / end the stream with ``finish_reason: "content_filter"``),
  ``mask`` (replace each span with ``[CATEGORY]``), ``flag`` (pass, record in the
  audit log).
* ``spans`` are ``(start, end, label)`` character offsets into ``text``; a
  ``mask`` verdict must carry the spans to mask, ``block``/``flag`` may.
* An empty list means the check found nothing. Checks are pure and
  thread-safe: same text in, same verdicts out; they never download a model.

Streaming (output moderation) uses :meth:`InputCheck.scan`, which also says
from where the text is still undecided::

    scan(text, pos, final) -> ScanResult(verdicts, hold_from)

Verdicts there are for spans that end at or after ``pos`` and are settled;
``hold_from`` is the smallest offset (>= ``pos``) at which a span could still
start or grow once more text arrives (``len(text)`` if none). The default
implementation re-runs :meth:`check` and holds back ``window`` characters;
pattern checks override it with exact partial-match holds.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

ACTIONS = ("block", "mask", "flag")


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    label: str


@dataclass(frozen=True)
class Verdict:
    """One finding. ``category`` is e.g. ``pii.email``, ``injection.prompt_injection``."""

    check: str
    category: str
    action: str
    spans: tuple[Span, ...] = ()
    score: float = 1.0
    detail: str = ""

    def to_dict(self) -> dict:
        """A JSON-ready dict (for the audit log's ``safety`` field)."""
        return {"check": self.check, "category": self.category, "action": self.action,
                "score": self.score, "detail": self.detail,
                "spans": [[s.start, s.end, s.label] for s in self.spans]}


@dataclass(frozen=True)
class ScanResult:
    verdicts: list[Verdict]
    hold_from: int


@dataclass
class CheckConfig:
    """A check's policy: default ``action``, per-category ``actions``, a category filter."""

    action: str = "block"
    actions: dict[str, str] = field(default_factory=dict)
    categories: list[str] | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for a in [self.action, *self.actions.values()]:
            if a not in ACTIONS:
                raise ValueError(f"safety action must be one of {ACTIONS}, got {a!r}")

    def action_for(self, category: str) -> str:
        short = category.split(".", 1)[-1]
        return self.actions.get(category, self.actions.get(short, self.action))

    def wants(self, category: str) -> bool:
        if self.categories is None:
            return True
        short = category.split(".", 1)[-1]
        return category in self.categories or short in self.categories


class InputCheck(abc.ABC):
    """A content check. Subclasses set ``name`` and implement :meth:`check`."""

    name: ClassVar[str] = ""
    default_action: ClassVar[str] = "block"  # when the policy entry gives no ``action``
    window: int = 64  # characters held back by the default :meth:`scan`

    def __init__(self, config: CheckConfig | None = None):
        self.config = config or CheckConfig(action=self.default_action)

    @abc.abstractmethod
    def check(self, text: str) -> list[Verdict]:
        """All findings in ``text`` (empty list: clean)."""

    def scan(self, text: str, pos: int = 0, final: bool = False) -> ScanResult:
        hold = len(text) if final else max(pos, len(text) - self.window)
        out = []
        for v in self.check(text):
            if v.spans and all(s.end < pos for s in v.spans):
                continue
            if not final and v.spans and min(s.start for s in v.spans) >= hold:
                continue
            out.append(v)
        return ScanResult(out, hold)

    def verdict(self, category: str, spans=(), score: float = 1.0, detail: str = "") -> Verdict:
        return Verdict(self.name, category, self.config.action_for(category),
                       tuple(spans), score, detail)


CHECKS: dict[str, type[InputCheck]] = {}


def register_check(cls: type[InputCheck]) -> type[InputCheck]:
    """Class decorator: make ``cls`` available to policies under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    CHECKS[cls.name] = cls
    return cls


def build_check(spec: dict) -> InputCheck:
    """Build a check from a policy entry ``{"check": NAME, "action": ..., ...}``.

    Keys: ``check`` (registered name), ``action`` (default: the check's
    ``default_action``, ``mask`` for ``pii``, ``block`` otherwise), ``actions`` (per category),
    ``categories`` (filter); any other key goes to ``options``.

    Raises:
        ValueError: unknown check name, bad action, or a malformed entry.
    """
    from llmserve.gateway.safety import load_builtin_checks

    load_builtin_checks()
    if not isinstance(spec, dict) or "check" not in spec:
        raise ValueError(f"safety policy entry must be a mapping with a 'check' key, got {spec!r}")
    spec = dict(spec)
    name = spec.pop("check")
    if name not in CHECKS:
        raise ValueError(f"unknown safety check {name!r}; known: {sorted(CHECKS)}")
    cats = spec.pop("categories", None)
    if cats is not None and not (isinstance(cats, list) and all(isinstance(c, str) for c in cats)):
        raise ValueError(f"safety check {name!r}: 'categories' must be a list of strings")
    actions = spec.pop("actions", {}) or {}
    if not isinstance(actions, dict):
        raise ValueError(f"safety check {name!r}: 'actions' must be a mapping")
    cfg = CheckConfig(action=spec.pop("action", CHECKS[name].default_action), actions=actions,
                      categories=cats,
                      options=spec)
    return CHECKS[name](cfg)

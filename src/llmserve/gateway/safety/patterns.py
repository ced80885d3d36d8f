"""Regex pattern checks with exact streaming holds (shared by the PII and rules checks).

Patterns are compiled with the `regex <https://pypi.org/project/regex/>`_ module,
whose ``partial=True`` matching says whether the end of the text could be the
beginning of a match. In :meth:`PatternCheck.scan` a match is *settled* when it is
complete and no longer match could start at the same place once more text comes
(``fullmatch(text, start, partial=True)`` fails); otherwise the text is held back
from the match's start. So a span is never released before it is decided, whatever
the pattern's length: no unsafe span can be split across stream deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

import regex
import yaml

from llmserve.gateway.safety.base import InputCheck, ScanResult, Span, Verdict


@dataclass(frozen=True)
class Pattern:
    """One compiled pattern: it reports ``category``; ``validator(text) -> bool`` confirms."""

    id: str
    category: str
    label: str
    compiled: Any
    validator: Any = None
    lang: str = ""


def load_data(name: str) -> dict:
    """Load ``llmserve/gateway/safety/data/NAME`` (YAML).

    Raises:
        ValueError: the file is missing or is not a YAML mapping.
    """
    try:
        text = resources.files("llmserve.gateway.safety").joinpath("data").joinpath(name).read_text(
            encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"safety data file {name!r} not found") from None
    return load_yaml_text(text, name)


def load_yaml_text(text: str, where: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"safety data {where}: bad YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"safety data {where}: expected a mapping at the top level")
    return data


# ``\b`` spelled with lookarounds: `regex` evaluates ``\b`` at the end of a truncated
# string as plain False (no partial match), while a lookahead there stays partial.
_WORD_BOUNDARY = r"(?:(?<!\w)(?=\w)|(?<=\w)(?!\w))"


def compile_pattern(src: str, where: str, ignore_case: bool = False):
    """Compile a data-file pattern (``\b`` rewritten so partial matching sees it).

    Raises:
        ValueError: the regex does not compile (names ``where``).
    """
    flags = regex.V0 | (regex.IGNORECASE if ignore_case else 0)
    try:
        return regex.compile(regex.sub(r"(?<!\\)\\b", lambda _: _WORD_BOUNDARY, src), flags)
    except regex.error as e:
        raise ValueError(f"safety pattern {where}: bad regex {src!r}: {e}") from None


@dataclass(frozen=True)
class Hit:
    pattern: Pattern
    start: int
    end: int


class PatternCheck(InputCheck):
    """A check made of :class:`Pattern` s. Subclasses fill ``self.patterns``."""

    patterns: list[Pattern]

    def _scan_hits(self, text: str, pos: int, final: bool) -> tuple[list[Hit], int]:
        hits: list[Hit] = []
        hold = len(text)
        for p in self.patterns:
            for m in p.compiled.finditer(text, pos, partial=not final):
                if m.partial:
                    hold = min(hold, m.start())
                    continue
                if not final and p.compiled.fullmatch(text, m.start(), partial=True):
                    hold = min(hold, m.start())
                    continue
                if m.end() > m.start() and (p.validator is None or p.validator(m.group())):
                    hits.append(Hit(p, m.start(), m.end()))
        return hits, hold

    def _verdicts(self, hits: list[Hit]) -> list[Verdict]:
        by_cat: dict[str, list[Hit]] = {}
        for h in hits:
            by_cat.setdefault(h.pattern.category, []).append(h)
        out = []
        for cat, hs in by_cat.items():
            spans = tuple(Span(h.start, h.end, h.pattern.label) for h in hs)
            out.append(self.verdict(cat, spans, detail=",".join(
                sorted({h.pattern.id for h in hs}))))
        return out

    def select(self, hits: list[Hit]) -> list[Hit]:
        """Filter by the policy's categories (subclasses also resolve overlaps)."""
        return [h for h in hits if self.config.wants(h.pattern.category)]

    def check(self, text: str) -> list[Verdict]:
        return self._verdicts(self.select(self._scan_hits(text, 0, True)[0]))

    def scan(self, text: str, pos: int = 0, final: bool = False) -> ScanResult:
        hits, hold = self._scan_hits(text, pos, final)
        hits = [h for h in self.select(hits) if h.start < hold]
        return ScanResult(self._verdicts(hits), hold)

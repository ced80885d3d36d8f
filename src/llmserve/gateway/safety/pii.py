"""PII detection and masking: e-mail, phone, payment card, IBAN, IP, CN resident ID, US SSN.

Patterns live in ``data/pii.yaml``; each candidate is confirmed by its validator
(Luhn, IBAN mod-97, GB 11643 check digit, SSA rules; see :mod:`.validators`).
Overlapping candidates resolve by the type's ``priority``, then by length.
Masking replaces each span with ``[LABEL]`` (``[EMAIL]``, ``[CARD]``, ...).

Policy entry: ``{"check": "pii", "action": "mask", "categories": ["email", "card"],
"actions": {"cn_resident_id": "block"}}``; categories are the type names in
``data/pii.yaml`` (``email, phone, card, iban, ipv4, ipv6, cn_resident_id, us_ssn``).
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from llmserve.gateway.safety.base import CheckConfig, Span, Verdict, register_check
from llmserve.gateway.safety.patterns import Hit, Pattern, PatternCheck, compile_pattern, load_data
from llmserve.gateway.safety.validators import VALIDATORS


@lru_cache(maxsize=1)
def pii_patterns() -> tuple[tuple[Pattern, int], ...]:
    """(pattern, priority) for every PII type in ``data/pii.yaml``."""
    data = load_data("pii.yaml")
    out = []
    for name, spec in (data.get("types") or {}).items():
        vname = spec.get("validator", "none")
        if vname not in VALIDATORS:
            raise ValueError(f"pii.yaml: type {name!r} names unknown validator {vname!r}")
        cat = "pii." + spec.get("category", name)
        for i, src in enumerate(spec.get("patterns") or []):
            out.append((Pattern(f"{name}-{i}", cat, spec.get("label", name.upper()),
                                compile_pattern(src, f"pii.yaml:{name}"),
                                None if vname == "none" else VALIDATORS[vname]),
                        int(spec.get("priority", 0))))
    return tuple(out)


PII_TYPES = ("email", "phone", "card", "iban", "ipv4", "ipv6", "cn_resident_id", "us_ssn")


@register_check
class PIICheck(PatternCheck):
    """Finds PII; with ``action: mask`` the pipeline replaces each span by ``[LABEL]``."""

    name = "pii"
    default_action = "mask"

    def __init__(self, config: CheckConfig | None = None):
        super().__init__(config)
        for c in self.config.categories or []:
            if c.split(".", 1)[-1] not in PII_TYPES:
                raise ValueError(f"pii check: unknown PII type {c!r}; known: {PII_TYPES}")
        pats = pii_patterns()
        self._priority = {p.id: prio for p, prio in pats}
        self.patterns = [p for p, _ in pats]

    def select(self, hits: list[Hit]) -> list[Hit]:
        hits = super().select(hits)
        hits.sort(key=lambda h: (-self._priority[h.pattern.id], -(h.end - h.start), h.start))
        chosen: list[Hit] = []
        for h in hits:
            if all(h.end <= c.start or h.start >= c.end for c in chosen):
                chosen.append(h)
        return sorted(chosen, key=lambda h: h.start)


def mask_spans(text: str, spans) -> str:
    """Replace each (non-overlapping) span of ``text`` by ``[LABEL]``."""
    out, last = [], 0
    for s in sorted(spans, key=lambda s: s.start):
        if s.start < last:
            continue
        out.append(text[last:s.start])
        out.append(f"[{s.label}]")
        last = s.end
    out.append(text[last:])
    return "".join(out)


def detect_pii(text: str, types=None) -> list[Span]:
    """PII spans in ``text`` (all types, or those in ``types``), in order."""
    chk = PIICheck(CheckConfig(action="mask", categories=list(types) if types else None))
    return sorted((s for v in chk.check(text) for s in v.spans), key=lambda s: s.start)


def mask_pii(text: str, types=None) -> tuple[str, Counter]:
    """(``text`` with PII masked, count per PII type)."""
    chk = PIICheck(CheckConfig(action="mask", categories=list(types) if types else None))
    verdicts: list[Verdict] = chk.check(text)
    counts = Counter({v.category.split(".", 1)[1]: len(v.spans) for v in verdicts})
    return mask_spans(text, [s for v in verdicts for s in v.spans]), counts

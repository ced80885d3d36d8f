"""PII redaction of the stored audit copy (per team policy), using the safety PII check.

``redact_record(record, pii_types)`` masks PII in every string inside ``request``
and ``response`` (``[EMAIL]``, ``[CARD]``, ...) and adds ``redactions``: the count
per PII type. ``pii_types`` is a list of type names (see
:data:`llmserve.gateway.safety.pii.PII_TYPES`) or ``"all"``. The hash chain covers
the redacted copy: the clear text is never stored.
"""

from __future__ import annotations

from collections import Counter

from llmserve.gateway.safety.pii import PII_TYPES, mask_pii

REDACTED_FIELDS = ("request", "response")


def _walk(value, types, counts: Counter):
    if isinstance(value, str):
        masked, c = mask_pii(value, types)
        counts.update(c)
        return masked
    if isinstance(value, list):
        return [_walk(v, types, counts) for v in value]
    if isinstance(value, dict):
        return {k: _walk(v, types, counts) for k, v in value.items()}
    return value


def redact_record(record: dict, pii_types) -> dict:
    """A copy of ``record`` with PII masked in ``request``/``response``.

    Raises:
        ValueError: an unknown PII type name.
    """
    types = None if pii_types == "all" else list(pii_types)
    for t in types or []:
        if t not in PII_TYPES:
            raise ValueError(f"audit redaction: unknown PII type {t!r}; known: {PII_TYPES}")
    counts: Counter = Counter()
    out = dict(record)
    for f in REDACTED_FIELDS:
        if f in out:
            out[f] = _walk(out[f], types, counts)
    out["redactions"] = dict(sorted(counts.items()))
    return out

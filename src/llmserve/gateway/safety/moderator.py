"""Streaming output moderation: hold back exactly the undecided tail of the stream.

::

    deltas --> [ released | held (undecided) ] --> client
                  ^ context for lookbehind

    feed(delta)  -> text safe to emit now (masked where a ``mask`` verdict says)
    finish()     -> ModerationResult(text, verdicts, finish_reason)

Each feed re-scans only ``context + held`` with every output check's
:meth:`~llmserve.gateway.safety.base.InputCheck.scan`, which reports settled
verdicts and ``hold_from``, the first offset a span could still start at. The
moderator releases text up to the smallest ``hold_from`` (never through a span),
so a span is always decided whole, whichever way the deltas cut it. On a
``block`` verdict it releases the text before the span, emits nothing more, and
:meth:`finish` returns ``finish_reason="content_filter"`` (the gateway then ends
the stream with it and aborts the upstream request).

``max_hold`` (characters, default 1024) bounds latency and memory: if more than
that is held, the held text is decided as if the stream had ended (a pattern
longer than ``max_hold`` could then be missed; the built-in ones are shorter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.gateway.safety.base import InputCheck, Span, Verdict
from llmserve.gateway.safety.pii import mask_spans


@dataclass
class ModerationResult:
    text: str
    verdicts: list[Verdict] = field(default_factory=list)
    finish_reason: str | None = None  # "content_filter" when blocked


class OutputModerator:
    """Moderates one streamed response. Not thread-safe: one instance per stream.

    Args:
        checks: the output checks (built from the team policy).
        max_hold: the most characters held back before deciding anyway.
        context: released characters kept as lookbehind context.

    Raises:
        ValueError: ``max_hold`` < 1.
    """

    def __init__(self, checks: list[InputCheck], max_hold: int = 1024, context: int = 256):
        if max_hold < 1:
            raise ValueError(f"max_hold must be >= 1, got {max_hold}")
        self.checks = list(checks)
        self.max_hold = max_hold
        self.context = context
        self._tail = ""      # last released raw characters (context)
        self._held = ""      # raw characters not yet released
        self._released = 0   # raw characters released so far
        self._seen: set = set()
        self.verdicts: list[Verdict] = []
        self.blocked: Verdict | None = None
        self._done = False

    @property
    def held(self) -> int:
        """Characters currently held back."""
        return len(self._held)

    def feed(self, delta: str) -> str:
        """Add a delta; return the text that is safe to send now ('' if none)."""
        if self._done or self.blocked is not None:
            return ""
        if not isinstance(delta, str):
            raise ValueError(f"delta must be str, got {type(delta).__name__}")
        self._held += delta
        out = self._step(final=False)
        if self.blocked is None and len(self._held) > self.max_hold:
            out += self._step(final=True)
        return out

    def finish(self) -> ModerationResult:
        """End of stream: decide the held text; return it and every verdict."""
        text = "" if self._done or self.blocked is not None else self._step(final=True)
        self._done = True
        return ModerationResult(text, list(self.verdicts),
                                "content_filter" if self.blocked is not None else None)

    def _step(self, final: bool) -> str:
        ctx = self._tail
        text = ctx + self._held
        pos = len(ctx)
        base = self._released - pos  # absolute offset of text[0]
        release = len(text)
        found: list[Verdict] = []
        for chk in self.checks:
            res = chk.scan(text, pos, final)
            release = min(release, max(pos, res.hold_from))
            found += res.verdicts
        block_at = None
        for v in found:
            if v.action == "block":
                start = min((s.start for s in v.spans), default=pos)
                block_at = start if block_at is None else min(block_at, start)
        if block_at is not None:
            release = min(release, max(pos, block_at))
        masks = [s for v in found if v.action == "mask" for s in v.spans if s.end > pos]
        moved = True
        while moved:  # never cut through a span that is to be masked
            moved = False
            for s in masks:
                if s.start < release < s.end:
                    release, moved = max(pos, s.start), True
        for v in found:
            if v.action == "block" or any(s.start < release for s in v.spans) or not v.spans:
                self._record(v, base)
        out = mask_spans(text[pos:release], [Span(s.start - pos, s.end - pos, s.label)
                                              for s in masks if s.end <= release])
        released_raw = text[pos:release]
        self._released += len(released_raw)
        self._tail = (ctx + released_raw)[-self.context:] if self.context else ""
        self._held = text[release:]
        if block_at is not None:
            self.blocked = next(v for v in found if v.action == "block")
        return out

    def _record(self, v: Verdict, base: int) -> None:
        key = (v.check, v.category, tuple((s.start + base, s.end + base) for s in v.spans))
        if key in self._seen:
            return
        self._seen.add(key)
        self.verdicts.append(Verdict(v.check, v.category, v.action,
                                     tuple(Span(s.start + base, s.end + base, s.label)
                                           for s in v.spans), v.score, v.detail))

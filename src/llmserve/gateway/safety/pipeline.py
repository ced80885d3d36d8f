"""The safety pipeline: a team policy -> input checks + an output moderator.

Policy (a dict, e.g. from the gateway YAML under ``teams.<name>.safety``)::

    input:                                  # run on the prompt before it reaches the model
      - {check: injection, action: block}
      - {check: harmful, action: block, categories: [weapons, self_harm]}
      - {check: pii, action: mask, actions: {cn_resident_id: block}}
      - {check: llm_judge, action: flag, url: http://127.0.0.1:8000/v1, model: default}
    output:                                 # run on the streamed response
      - {check: harmful, action: block}
      - {check: pii, action: mask}
    output_max_hold: 1024                   # characters (see moderator.py)

``block`` rejects (HTTP 400, OpenAI error ``code: content_filter``) / ends the
stream with ``finish_reason: "content_filter"``; ``mask`` replaces spans with
``[LABEL]``; ``flag`` passes and records the verdict (for the audit log).
No policy (``None``) means no checks.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from llmserve.gateway.safety.base import InputCheck, Verdict, build_check
from llmserve.gateway.safety.moderator import OutputModerator
from llmserve.gateway.safety.pii import mask_spans

_POLICY_KEYS = {"input", "output", "output_max_hold"}


@dataclass
class InputResult:
    """``text``: the prompt to forward (masked); ``blocked``: the first block verdict."""

    text: str
    verdicts: list[Verdict] = field(default_factory=list)
    blocked: Verdict | None = None

    @property
    def flagged(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.action == "flag"]


class SafetyPipeline:
    """Runs input checks and makes per-stream :class:`OutputModerator` s. Thread-safe."""

    def __init__(self, input_checks: list[InputCheck] = (), output_checks: list[InputCheck] = (),
                 output_max_hold: int = 1024):
        self.input_checks = list(input_checks)
        self.output_checks = list(output_checks)
        self.output_max_hold = output_max_hold

    @classmethod
    def from_policy(cls, policy: dict | None) -> SafetyPipeline:
        """Build from a policy dict (see the module docstring).

        Raises:
            ValueError: unknown key, unknown check, bad action or options.
        """
        if policy is None:
            return cls()
        if not isinstance(policy, dict):
            raise ValueError(f"safety policy must be a mapping, got {type(policy).__name__}")
        unknown = set(policy) - _POLICY_KEYS
        if unknown:
            raise ValueError(f"unknown safety policy keys {sorted(unknown)}; "
                             f"allowed: {sorted(_POLICY_KEYS)}")
        for k in ("input", "output"):
            if not isinstance(policy.get(k) or [], list):
                raise ValueError(f"safety policy {k!r} must be a list of check entries")
        hold = policy.get("output_max_hold", 1024)
        if not isinstance(hold, int) or isinstance(hold, bool) or hold < 1:
            raise ValueError(f"safety policy 'output_max_hold' must be an int >= 1, got {hold!r}")
        return cls([build_check(e) for e in policy.get("input") or []],
                   [build_check(e) for e in policy.get("output") or []], hold)

    def check_input(self, text: str) -> InputResult:
        """Run every input check on ``text``; mask the ``mask`` spans."""
        verdicts = [v for chk in self.input_checks for v in chk.check(text)]
        blocked = next((v for v in verdicts if v.action == "block"), None)
        spans = sorted((s for v in verdicts if v.action == "mask" for s in v.spans),
                       key=lambda s: (s.start, -(s.end - s.start)))
        return InputResult(mask_spans(text, spans), verdicts, blocked)

    def check_messages(self, messages: list[dict]) -> tuple[list[dict], InputResult]:
        """Check each chat message's text (string content or ``type: text`` parts).

        Returns (messages with masked text, combined result; ``text`` there is
        the masked texts joined by newlines).
        """
        out, verdicts, texts, blocked = [], [], [], None
        for msg in messages:
            msg = dict(msg)
            content = msg.get("content")
            if isinstance(content, str):
                r = self.check_input(content)
                msg["content"] = r.text
                results = [r]
            elif isinstance(content, list):
                parts, results = [], []
                for part in content:
                    if isinstance(part, dict) and part.get("type") == "text" and isinstance(
                            part.get("text"), str):
                        r = self.check_input(part["text"])
                        part = dict(part, text=r.text)
                        results.append(r)
                    parts.append(part)
                msg["content"] = parts
            else:
                results = []
            for r in results:
                verdicts += r.verdicts
                texts.append(r.text)
                blocked = blocked or r.blocked
            out.append(msg)
        return out, InputResult("\n".join(texts), verdicts, blocked)

    async def acheck_input(self, text: str) -> InputResult:
        """:meth:`check_input` in a worker thread (the LLM judge makes blocking HTTP calls)."""
        return await asyncio.to_thread(self.check_input, text)

    def output_moderator(self) -> OutputModerator:
        """A fresh moderator for one streamed (or whole) response."""
        return OutputModerator(self.output_checks, max_hold=self.output_max_hold)

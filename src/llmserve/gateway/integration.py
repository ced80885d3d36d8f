"""Adapters from the audit log and the safety pipeline to the gateway app's hook points.

The gateway app (``gateway/app.py``, ``gateway/hooks.py``) calls three small
protocols; these classes implement them on top of :class:`~.audit.AuditLog` and
:class:`~.safety.SafetyPipeline`::

    GatewaySafety(policies).check_input(body, ctx) -> hooks.InputVerdict     (async)
    GatewaySafety(policies).output_moderator(ctx)  -> per-choice feed/finish -> hooks.OutputStep
    GatewayAudit(AuditLog(url), redact).record(record)                        (async, never raises)

The team's policy is ``ctx.team_policy["safety"]`` if present, else
``policies[ctx.team]``, else ``policies.get("default")``; see ``safety/pipeline.py``
for its format. ``hooks`` is imported lazily (it lives with the gateway app).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
from typing import Any

from llmserve.gateway.audit import AuditLog
from llmserve.gateway.safety import SafetyPipeline

logger = logging.getLogger(__name__)


class GatewaySafety:
    """Per-team safety pipelines (built once per distinct policy, then cached)."""

    def __init__(self, policies: dict[str, dict] | None = None):
        self.policies = dict(policies or {})
        self._cache: dict[str, SafetyPipeline] = {}

    def pipeline_for(self, ctx) -> SafetyPipeline:
        team_policy = getattr(ctx, "team_policy", None) or {}
        policy = team_policy.get("safety")
        if policy is None:
            policy = self.policies.get(getattr(ctx, "team", None) or "",
                                       self.policies.get("default"))
        key = json.dumps(policy, sort_keys=True, default=str)
        if key not in self._cache:
            self._cache[key] = SafetyPipeline.from_policy(policy)
        return self._cache[key]

    async def check_input(self, body: dict[str, Any], ctx):
        import asyncio

        from llmserve.gateway.hooks import InputVerdict

        pipe = self.pipeline_for(ctx)
        if not pipe.input_checks:
            return InputVerdict()
        new_body, result = await asyncio.to_thread(_check_body, pipe, body)
        verdicts = [v.to_dict() for v in result.verdicts]
        if result.blocked is not None:
            b = result.blocked
            return InputVerdict(action="block", verdicts=verdicts,
                                message=f"request blocked by content safety ({b.category})")
        changed = new_body != body
        return InputVerdict(action="allow", body=new_body if changed else None,
                            verdicts=verdicts)

    def output_moderator(self, ctx):
        pipe = self.pipeline_for(ctx)
        return _ChoiceModerator(pipe) if pipe.output_checks else None


def _check_body(pipe: SafetyPipeline, body: dict):
    from llmserve.gateway.safety.pipeline import InputResult

    body = dict(body)
    if isinstance(body.get("messages"), list):
        body["messages"], result = pipe.check_messages(body["messages"])
        return body, result
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if isinstance(prompts, list) and all(isinstance(p, str) for p in prompts):
        results = [pipe.check_input(p) for p in prompts]
        masked = [r.text for r in results]
        body["prompt"] = masked[0] if isinstance(prompt, str) else masked
        verdicts = [v for r in results for v in r.verdicts]
        blocked = next((r.blocked for r in results if r.blocked is not None), None)
        return body, InputResult("\n".join(masked), verdicts, blocked)
    return body, InputResult("", [], None)  # token-id prompts: nothing to read


class _ChoiceModerator:
    """One :class:`~.safety.OutputModerator` per OpenAI choice index."""

    def __init__(self, pipe: SafetyPipeline):
        self.pipe = pipe
        self._mods: dict[int, Any] = {}
        self._reported: dict[int, int] = {}

    def _mod(self, choice: int):
        if choice not in self._mods:
            self._mods[choice] = self.pipe.output_moderator()
            self._reported[choice] = 0
        return self._mods[choice]

    def _new_verdicts(self, choice: int) -> list[dict]:
        m = self._mods[choice]
        new = m.verdicts[self._reported[choice]:]
        self._reported[choice] = len(m.verdicts)
        return [v.to_dict() for v in new]

    def feed(self, choice: int, text: str):
        from llmserve.gateway.hooks import OutputStep

        m = self._mod(choice)
        out = m.feed(text)
        return OutputStep(out, m.blocked is not None, self._new_verdicts(choice))

    def finish(self, choice: int):
        from llmserve.gateway.hooks import OutputStep

        m = self._mod(choice)
        res = m.finish()
        return OutputStep(res.text, res.finish_reason == "content_filter",
                          self._new_verdicts(choice))


def gateway_record_to_audit(record: dict) -> dict:
    """Map the gateway's record (``hooks.py``) to :func:`.audit.validate_record` fields.

    ``time`` (unix s) -> ISO 8601 UTC; ``response_text`` -> ``response`` (choices
    joined by a blank line when several); ``prompt_tokens``/``completion_tokens`` ->
    ``usage``; ``latency_s`` -> ``latency_ms``; every other key is kept.
    """
    rec = dict(record)
    t = rec.get("time")
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        rec["time"] = _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(
            timespec="milliseconds")
    if "response_text" in rec:
        text = rec.pop("response_text")
        rec["response"] = "\n\n".join(text) if isinstance(text, list) else text
    pt, ct = rec.pop("prompt_tokens", None), rec.pop("completion_tokens", None)
    if pt is not None or ct is not None:
        rec["usage"] = {"prompt_tokens": pt, "completion_tokens": ct,
                        "total_tokens": (pt or 0) + (ct or 0)}
    if "latency_s" in rec:
        lat = rec.pop("latency_s")
        rec["latency_ms"] = round(lat * 1000.0, 3) if isinstance(lat, (int, float)) else lat
    return rec


class GatewayAudit:
    """The gateway's audit sink: appends each record to an :class:`AuditLog`.

    ``redact``: team -> PII types to mask in the stored copy (``"all"`` or a list);
    ``"default"`` applies to teams not listed. Errors are logged, never raised.
    """

    def __init__(self, log: AuditLog | str, redact: dict[str, Any] | None = None):
        self.log = AuditLog(log) if isinstance(log, str) else log
        self.redact = dict(redact or {})

    async def record(self, record: dict[str, Any]) -> None:
        try:
            rec = gateway_record_to_audit(record)
            types = self.redact.get(rec.get("team") or "", self.redact.get("default"))
            await self.log.aappend(rec, redact_pii=types)
        except Exception:  # the gateway must keep serving; the log says what was lost
            logger.exception("audit record %s was not stored", record.get("request_id"))

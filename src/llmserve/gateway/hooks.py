"""Hook points of the gateway app for the audit log and the content-safety pipeline.

Both are optional arguments of :func:`llmserve.gateway.app.build_app`; the gateway
works without them. They are small :class:`typing.Protocol` classes, so an
implementation needs no base class, only these methods.

Where they are called, per inference request (``/v1/completions``,
``/v1/chat/completions``)::

    authenticate -> RBAC/model check -> safety.check_input(body, ctx)   (may block/rewrite)
      -> admit limits -> upstream
      -> non-streamed: moderator.feed(0, full text) ... moderator.finish(0)
         streamed:     moderator.feed(choice, delta) per SSE chunk; finish(choice) at end
      -> settle limits -> audit.record(record)              (exactly once, also on abort)

``ctx`` is a :class:`RequestContext`. The audit record is a JSON-serializable dict:
``{request_id, time (unix s, arrival), key_id, team, role, model, endpoint, request
(the body as forwarded), response_text (the text the client got, after output
moderation: the full text, or the streamed deltas joined; one string per choice), stream, status (HTTP code sent), outcome ("ok", "aborted",
"upstream_error", "rejected"), error, prompt_tokens, completion_tokens, latency_s,
safety (list of verdict dicts)}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class RequestContext:
    """Who is asking what. ``team_policy`` holds the team's record (or {})."""

    request_id: str
    key_id: str
    team: str | None
    role: str
    model: str
    endpoint: str
    team_policy: dict = field(default_factory=dict)


@dataclass
class InputVerdict:
    """Result of :meth:`SafetyPipeline.check_input`.

    ``action``: ``"allow"`` (forward ``body``, possibly rewritten, e.g. PII masked),
    ``"block"`` (answer 400, error code ``content_filter``, with ``message``).
    ``verdicts``: per-check details, copied into the audit record's ``safety``."""

    action: str = "allow"
    body: dict | None = None  # None = unchanged
    message: str = ""
    verdicts: list[dict] = field(default_factory=list)


@dataclass
class OutputStep:
    """What a moderator lets out after a piece of text. ``text``: the part now safe
    to send to the client (a held-back window may keep a tail until later);
    ``stop``: end this choice now with ``finish_reason: "content_filter"``."""

    text: str
    stop: bool = False
    verdicts: list[dict] = field(default_factory=list)


@runtime_checkable
class OutputModerator(Protocol):
    """Moderates one response's text as it is produced. One instance per request;
    ``choice`` is the OpenAI choice index. Invariant: the concatenation of every
    ``OutputStep.text`` returned (feed then finish) is all the client gets."""

    def feed(self, choice: int, text: str) -> OutputStep: ...

    def finish(self, choice: int) -> OutputStep: ...


@runtime_checkable
class SafetyPipeline(Protocol):
    """Input check and output moderation. ``check_input`` must not raise on bad
    content (return ``block``); an exception there is a 500-free 503 in the gateway."""

    async def check_input(self, body: dict[str, Any], ctx: RequestContext) -> InputVerdict: ...

    def output_moderator(self, ctx: RequestContext) -> OutputModerator | None: ...


@runtime_checkable
class AuditSink(Protocol):
    """Receives one record per inference request when its response has ended
    (completed, failed, rejected, refused at authentication, or aborted by
    the client).
    Must not raise; the gateway logs and drops an exception."""

    async def record(self, record: dict[str, Any]) -> None: ...

"""The JSONL of OpenAI's Batch API (https://platform.openai.com/docs/guides/batch).

Input, one request a line::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 64}}

Output, one result a line (in input order; OpenAI's output/error file lines)::

    {"id": "batch_req_...", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}},
     "error": null}

A request the server answers with an error keeps ``response`` with its status and
OpenAI error body; a request that could not run at all has ``response: null`` and
``error: {"code", "message"}``.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class BatchItem:
    """One input line: its 0-based ``index`` in the file, ``custom_id``, ``url`` and
    ``body`` (the request JSON object)."""

    index: int
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_batch(text: str, source: str = "input", endpoint: str | None = None
                ) -> list[BatchItem]:
    """Parse and check a batch input file.

    Args:
        text: the JSONL text (blank lines are skipped).
        source: the name used in error messages (a path or a file id).
        endpoint: when given, every line's ``url`` must be this one (the server's
            ``/v1/batches`` names one endpoint per batch).

    Raises:
        ValueError: names the line and field: not a JSON object, ``custom_id`` missing,
            not a string, too long or repeated, ``method`` not POST, ``url`` not one of
            :data:`ENDPOINTS` (or not ``endpoint``), ``body`` not an object, or no lines.
    """
    items: list[BatchItem] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source} line {lineno}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object")
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise ValueError(f"{where}: custom_id must be a non-empty string")
        if len(cid) > MAX_CUSTOM_ID:
            raise ValueError(f"{where}: custom_id is longer than {MAX_CUSTOM_ID} characters")
        if cid in seen:
            raise ValueError(f"{where}: custom_id {cid!r} repeats line {seen[cid]}; "
                             f"each custom_id must be unique in a batch")
        seen[cid] = lineno
        method = obj.get("method", "POST")
        if method != "POST":
            raise ValueError(f"{where}: method must be POST, got {method!r}")
        url = obj.get("url")
        if url not in ENDPOINTS:
            raise ValueError(f"{where}: url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
        if endpoint is not None and url != endpoint:
            raise ValueError(f"{where}: url {url!r} differs from the batch's endpoint "
                             f"{endpoint!r}")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise ValueError(f"{where}: body must be a JSON object (the request)")
        items.append(BatchItem(len(items), cid, url, body))
    if not items:
        raise ValueError(f"{source}: the batch has no requests")
    return items


def digest(text: str) -> str:
    """sha256 of the input text (a checkpoint belongs to one input)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def result_line(item: BatchItem, status: int | None, body: dict | None,
                error: dict | None = None) -> str:
    """One output line (see the module docstring)."""
    response = None
    if status is not None:
        response = {"status_code": status,
                    "request_id": (body or {}).get("id") or f"req_{uuid.uuid4().hex}",
                    "body": body}
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.custom_id,
                       "response": response, "error": error}, ensure_ascii=False)

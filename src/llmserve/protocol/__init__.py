"""The OpenAI API's request and response models, shared by the server, the gateway and
the router (serving plane: imports pydantic only, never torch or the engine).

- :mod:`llmserve.protocol.openai`: the pydantic models of ``/v1/completions``,
  ``/v1/chat/completions``, ``/v1/models``, ``/tokenize``, ``/detokenize`` and errors.
- :func:`validation_message`: one error message (and the field to name as ``param``)
  for a list of pydantic validation errors, as every llmserve process answers a
  malformed body: HTTP 400 with an OpenAI-style error body.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def validation_message(errors: Iterable[dict[str, Any]]) -> tuple[str, str | None]:
    """``(message, param)`` for pydantic's ``errors()`` (a ``ValidationError`` or
    FastAPI's ``RequestValidationError``): every error as ``field.path: reason``,
    joined with ``"; "``; ``param`` is the first field named. A body that is not JSON
    is reported with the character offset pydantic gives."""
    parts, param = [], None
    for err in errors:
        if err.get("type") == "json_invalid":  # loc holds a character offset, not a field
            parts.append(f"the body is not valid JSON: {err.get('msg', 'invalid')} "
                         f"(at character {err.get('loc', ('', '?'))[-1]})")
            continue
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request", param

"""Content safety for the gateway: a pipeline of pluggable checks, configured per team.

Checks (registered by name, see :mod:`.base`): ``pii`` (detect/mask PII),
``injection`` and ``harmful`` (the English/Chinese rules classifier, patterns in
``data/*.yaml``), ``llm_judge`` (a served model with a Llama-Guard-style prompt).
:class:`SafetyPipeline` runs a team policy's input checks on prompts and builds an
:class:`OutputModerator` for streamed output. Imports neither torch nor the engine.
"""

from __future__ import annotations


def load_builtin_checks() -> None:
    """Import the built-in check modules so they register themselves."""
    from llmserve.gateway.safety import llm_judge, pii, rules  # noqa: F401


from llmserve.gateway.safety.base import (  # noqa: E402
    CHECKS,
    CheckConfig,
    InputCheck,
    ScanResult,
    Span,
    Verdict,
    build_check,
    register_check,
)
from llmserve.gateway.safety.moderator import OutputModerator  # noqa: E402
from llmserve.gateway.safety.pipeline import InputResult, SafetyPipeline  # noqa: E402

__all__ = ["CHECKS", "CheckConfig", "InputCheck", "InputResult", "OutputModerator",
           "SafetyPipeline", "ScanResult", "Span", "Verdict", "build_check",
           "load_builtin_checks", "register_check"]

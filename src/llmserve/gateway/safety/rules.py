"""The fast rules-and-patterns classifier (English and Chinese), two checks:

* ``injection``: prompt injection, jailbreak, system-prompt extraction;
* ``harmful``: violence, weapons, self_harm, sexual_minors, hate, drugs, cybercrime.

Patterns live in ``data/rules_en.yaml`` and ``data/rules_zh.yaml`` (case-insensitive,
`regex` syntax); each category names its ``group``. Extra files can be added to a
policy entry with ``files: [PATH, ...]`` (same format). Verdict categories are
``injection.<category>`` / ``harmful.<category>``; ``detail`` lists the pattern ids.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from llmserve.gateway.safety.base import CheckConfig, register_check
from llmserve.gateway.safety.patterns import (
    Pattern,
    PatternCheck,
    compile_pattern,
    load_data,
    load_yaml_text,
)

RULE_FILES = ("rules_en.yaml", "rules_zh.yaml")


def _patterns_from(data: dict, where: str, group: str) -> list[Pattern]:
    out = []
    cats = data.get("categories")
    if not isinstance(cats, dict):
        raise ValueError(f"safety rules {where}: 'categories' must be a mapping")
    for cat, spec in cats.items():
        if spec.get("group") != group:
            continue
        for i, p in enumerate(spec.get("patterns") or []):
            if not isinstance(p, dict) or "regex" not in p:
                raise ValueError(f"safety rules {where}: {cat} pattern {i} needs a 'regex'")
            pid = p.get("id", f"{cat}-{i}")
            out.append(Pattern(pid, f"{group}.{cat}", cat.upper(),
                               compile_pattern(p["regex"], f"{where}:{pid}", ignore_case=True),
                               lang=p.get("lang", "")))
    return out


@lru_cache(maxsize=4)
def builtin_rules(group: str) -> tuple[Pattern, ...]:
    pats: list[Pattern] = []
    for f in RULE_FILES:
        pats += _patterns_from(load_data(f), f, group)
    return tuple(pats)


class RulesCheck(PatternCheck):
    group = ""

    def __init__(self, config: CheckConfig | None = None):
        super().__init__(config)
        self.patterns = list(builtin_rules(self.group))
        for path in self.config.options.get("files", []) or []:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except OSError as e:
                raise ValueError(f"safety rules file {path}: {e}") from None
            self.patterns += _patterns_from(load_yaml_text(text, path), path, self.group)


@register_check
class InjectionCheck(RulesCheck):
    """Prompt injection / jailbreak / system-prompt extraction (rules)."""

    name = "injection"
    group = "injection"


@register_check
class HarmfulCheck(RulesCheck):
    """Harmful-content request or text, by named category (rules)."""

    name = "harmful"
    group = "harmful"

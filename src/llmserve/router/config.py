"""``router.yaml``: the router's optional config file (``llmserve router --config``).

Layout (every section optional; command-line ``--worker`` URLs are added to
``workers``)::

    workers: [http://10.0.0.1:8000, http://10.0.0.2:8000]
    tiers:                       # tier aliases, see llmserve.router.tiers
      auto:
        escalate_on: [length]
        levels: [{model: small, max_score: 0.35}, {model: large}]

Errors: :class:`ValueError` naming the file and the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.router.tiers import TierRoute, parse_tiers


@dataclass(frozen=True)
class RouterFileConfig:
    workers: tuple[str, ...] = ()
    tiers: dict[str, TierRoute] = field(default_factory=dict)


def load_router_config(path: str) -> RouterFileConfig:
    """Read and check ``path`` (YAML; JSON is YAML too).

    Raises:
        ValueError: unreadable or invalid YAML, an unknown section, a bad field.
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read the router config: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the router config must be a mapping")
    unknown = set(raw) - {"workers", "tiers"}
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {sorted(unknown)}; allowed: "
                         f"['tiers', 'workers']")
    workers = raw.get("workers") or []
    if not isinstance(workers, list) or not all(isinstance(u, str) for u in workers):
        raise ValueError(f"{path}: 'workers' must be a list of URLs")
    try:
        tiers = parse_tiers(raw.get("tiers"))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return RouterFileConfig(tuple(workers), tiers)

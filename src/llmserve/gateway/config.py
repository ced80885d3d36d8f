"""Gateway configuration: command-line settings plus an optional YAML file.

YAML layout (every section optional)::

    max_body_bytes: 4194304          # larger request bodies get 413
    key_cache_ttl_s: 0.5             # local cache of key records (< 1 s: revocations
                                     # reach every replica within one second)
    fail_open: {auth: false, rpm: false, tpm: false, parallel: false, quota: false}
                                     # Redis down: true = skip that limit (auth: use key
                                     # records cached in the last 5 min); false = 503
    teams:
      research: {models: [m1], rpm: 100, tpm: 50000, max_parallel_requests: 8,
                 daily_token_quota: 1000000, priority: 0,
                 safety: {input: [{check: pii, action: block}]}}  # overrides `safety`
    keys:
      - {id: k1, name: ci, team: research, role: member,
         key_hash: "sha256$<salt hex>$<digest hex>",   # from `python -m llmserve.gateway.keys new`
         models: null, rpm: 10, tpm: null, max_parallel_requests: null,
         daily_token_quota: null, priority: -1, expires_at: null}
    audit_db: sqlite:///var/llmserve/audit.db   # or postgresql://...; --audit-db overrides
    audit_redact: {default: [email], research: all}   # PII types masked in the stored copy
    safety:                          # team -> policy (safety/pipeline.py); "default" for
      default: {input: [{check: pii, action: mask}]}  # teams not listed
      research: {input: [{check: injection}], output: [{check: harmful}]}

Limits left out or ``null`` are unlimited. Keys and teams from the file are written to
Redis only where absent, so run-time admin changes survive a restart.

Errors: :class:`ValueError` naming the field and file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LIMIT_KINDS = ("rpm", "tpm", "parallel", "quota")
FAIL_OPEN_NAMES = ("auth", *LIMIT_KINDS)  # auth: use cached key records when Redis is down
LIMIT_FIELDS = ("rpm", "tpm", "max_parallel_requests", "daily_token_quota")
ROLES = ("admin", "member", "viewer")


def _opt_int(where: str, name: str, value: Any, minimum: int = 0) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: '{name}' must be an integer >= {minimum} or null, "
                         f"got {value!r}")
    return value


def check_models(where: str, value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(m, str) and m for m in value):
        raise ValueError(f"{where}: 'models' must be a list of model names or null")
    return list(value)


def check_team(where: str, raw: Any) -> dict:
    """A team record (models allowlist, limits, priority, safety policy) from config or
    the admin API. ``safety`` (a policy as in the top-level ``safety`` section) overrides
    that section for the team; set by ``PUT /admin/teams/{name}`` it reaches every
    replica with the team record."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a team must be a mapping")
    unknown = set(raw) - {"models", "priority", "safety", *LIMIT_FIELDS}
    if unknown:
        raise ValueError(f"{where}: unknown team field(s) {sorted(unknown)}")
    out = {f: _opt_int(where, f, raw.get(f)) for f in LIMIT_FIELDS}
    out["models"] = check_models(where, raw.get("models"))
    out["priority"] = _opt_int(where, "priority", raw.get("priority"), minimum=-(2**31))
    if raw.get("safety") is not None:
        from llmserve.gateway.safety import SafetyPipeline

        try:
            SafetyPipeline.from_policy(raw["safety"])
        except ValueError as e:
            raise ValueError(f"{where}: safety: {e}") from None
    out["safety"] = raw.get("safety")
    return out


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway app needs. ``upstreams``: base URLs of OpenAI-compatible
    servers (round robin, next one on connection errors)."""

    upstreams: tuple[str, ...]
    redis_url: str
    master_key: str | None = None
    upstream_api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    key_cache_ttl_s: float = 0.5
    fail_open: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(FAIL_OPEN_NAMES, False))
    teams: dict[str, dict] = field(default_factory=dict)
    keys: tuple[dict, ...] = ()
    upstream_timeout_s: float = 600.0
    audit_db: str | None = None
    audit_redact: dict[str, Any] = field(default_factory=dict)
    safety: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ValueError("at least one --upstream URL is required")
        for u in self.upstreams:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"--upstream must be an http(s) URL, got {u!r}")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis-url must be redis://, rediss:// or unix://, "
                             f"got {self.redis_url!r}")
        if self.master_key is not None and len(self.master_key) < 8:
            raise ValueError("LLMSERVE_MASTER_KEY must be at least 8 characters")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if not 0 < self.key_cache_ttl_s <= 1.0:
            raise ValueError("key_cache_ttl_s must be in (0, 1] (changes must reach every "
                             "replica within one second)")
        unknown = set(self.fail_open) - set(FAIL_OPEN_NAMES)
        if unknown:
            raise ValueError(f"fail_open: unknown name(s) {sorted(unknown)}; "
                             f"allowed {list(FAIL_OPEN_NAMES)}")
        if self.audit_db is not None and not self.audit_db.startswith(
                ("sqlite:///", "postgresql://", "postgres://")):
            raise ValueError(f"--audit-db must be sqlite:///PATH or postgresql://..., "
                             f"got {self.audit_db!r}")


def load_yaml(path: str) -> dict:
    """Read and check the YAML file; returns the keyword arguments it sets."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: the top level must be a mapping")
    allowed = {"max_body_bytes", "key_cache_ttl_s", "fail_open", "teams", "keys",
               "audit_db", "audit_redact", "safety"}
    unknown = set(raw) - allowed
    if unknown:
        raise ValueError(f"--config {path}: unknown field(s) {sorted(unknown)}")
    out: dict[str, Any] = {}
    if "max_body_bytes" in raw:
        out["max_body_bytes"] = _opt_int(path, "max_body_bytes", raw["max_body_bytes"], 1024)
    if "key_cache_ttl_s" in raw:
        if not isinstance(raw["key_cache_ttl_s"], (int, float)):
            raise ValueError(f"{path}: 'key_cache_ttl_s' must be a number")
        out["key_cache_ttl_s"] = float(raw["key_cache_ttl_s"])
    fo = raw.get("fail_open") or {}
    if not isinstance(fo, dict) or not all(isinstance(v, bool) for v in fo.values()):
        raise ValueError(f"{path}: 'fail_open' must map limit names to true/false")
    out["fail_open"] = {**dict.fromkeys(FAIL_OPEN_NAMES, False), **fo}
    teams = raw.get("teams") or {}
    if not isinstance(teams, dict):
        raise ValueError(f"{path}: 'teams' must be a mapping of team name -> settings")
    out["teams"] = {str(n): check_team(f"{path}: teams.{n}", t) for n, t in teams.items()}
    keys = raw.get("keys") or []
    if not isinstance(keys, list):
        raise ValueError(f"{path}: 'keys' must be a list")
    from llmserve.gateway.keys import check_key_fields

    checked = []
    for i, k in enumerate(keys):
        where = f"{path}: keys[{i}]"
        if not isinstance(k, dict) or not isinstance(k.get("id"), str) \
                or not isinstance(k.get("key_hash"), str):
            raise ValueError(f"{where}: needs string 'id' and 'key_hash'")
        rec = check_key_fields(where, {f: v for f, v in k.items()
                                       if f not in ("id", "key_hash")}, partial=False)
        rec.update(id=k["id"], key_hash=k["key_hash"])
        checked.append(rec)
    out["keys"] = tuple(checked)
    out.update(_audit_and_safety(path, raw))
    return out


def _audit_and_safety(path: str, raw: dict) -> dict:
    """``audit_db``, ``audit_redact`` and ``safety`` (each policy built once to check it)."""
    out: dict[str, Any] = {}
    if raw.get("audit_db") is not None:
        if not isinstance(raw["audit_db"], str):
            raise ValueError(f"{path}: 'audit_db' must be a URL string")
        out["audit_db"] = raw["audit_db"]
    redact = raw.get("audit_redact") or {}
    if not isinstance(redact, dict) or not all(
            v == "all" or (isinstance(v, list) and all(isinstance(t, str) for t in v))
            for v in redact.values()):
        raise ValueError(f"{path}: 'audit_redact' must map team -> \"all\" or a list of "
                         f"PII types")
    out["audit_redact"] = {str(k): v for k, v in redact.items()}
    safety = raw.get("safety") or {}
    if not isinstance(safety, dict):
        raise ValueError(f"{path}: 'safety' must map team (or 'default') -> policy")
    from llmserve.gateway.safety import SafetyPipeline

    for team, policy in safety.items():
        try:
            SafetyPipeline.from_policy(policy)
        except ValueError as e:
            raise ValueError(f"{path}: safety.{team}: {e}") from None
    out["safety"] = {str(k): v for k, v in safety.items()}
    return out

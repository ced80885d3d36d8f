"""API keys: secrets, salted hashes, records in Redis with a short local cache.

A secret looks like ``sk-<key id>.<random>``; the key id (public, 12 hex digits)
finds the record, the salted hash in the record checks the whole secret in constant
time (:func:`hmac.compare_digest`). Secrets are returned once, on creation, and never
stored or logged.

Redis layout (values are JSON)::

    gw:key:<id>    -> key record {id, name, team, role, models, rpm, tpm,
                      max_parallel_requests, daily_token_quota, priority,
                      expires_at (unix s | null), revoked, created_at, key_hash}
    gw:keys        -> set of key ids
    gw:team:<name> -> team record {models, rpm, tpm, max_parallel_requests,
                      daily_token_quota, priority}

Every replica reads records through a cache that holds them for ``ttl_s`` (< 1 s), so
an admin change made through any replica is seen by all within one second. If Redis
cannot be reached, a record cached within ``stale_s`` is used (it is still checked for
revocation and expiry as last seen) if the store was made with ``stale_s > 0`` (the
``fail_open.auth`` setting); otherwise :class:`StoreUnavailable` is raised.

CLI: ``python -m llmserve.gateway.keys new [ID]`` prints a fresh secret and the
``id``/``key_hash`` pair to put in gateway.yaml.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import json
import re
import secrets
import sys
import time
from typing import Any

from llmserve.gateway.config import LIMIT_FIELDS, ROLES, _opt_int, check_models

KEY_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SECRET_RE = re.compile(r"^sk-([A-Za-z0-9_-]{1,64})\.([A-Za-z0-9_-]{16,128})$")
KEY_FIELDS = ("name", "team", "role", "models", *LIMIT_FIELDS, "priority", "expires_at")


class StoreUnavailable(Exception):
    """Redis could not be reached and no usable cached copy exists."""


def new_secret(key_id: str | None = None) -> tuple[str, str]:
    """A fresh ``(key_id, secret)``; ``secret = "sk-<key_id>.<43 url-safe chars>"``."""
    key_id = key_id or secrets.token_hex(6)
    if not KEY_ID_RE.match(key_id):
        raise ValueError(f"key id {key_id!r}: use 1-64 of A-Z a-z 0-9 _ -")
    return key_id, f"sk-{key_id}.{secrets.token_urlsafe(32)}"


def hash_secret(secret: str, salt: bytes | None = None) -> str:
    """``"sha256$<salt hex>$<sha256(salt || secret) hex>"``; a random 16-byte salt.
    The secrets are 256-bit random strings, so one salted SHA-256 resists guessing."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    return f"sha256${salt.hex()}${hashlib.sha256(salt + secret.encode()).hexdigest()}"


def verify_secret(secret: str, key_hash: str) -> bool:
    """Constant-time check of ``secret`` against a :func:`hash_secret` string."""
    try:
        algo, salt_hex, digest = key_hash.split("$")
        salt = bytes.fromhex(salt_hex)
    except ValueError:
        return False
    if algo != "sha256":
        return False
    return hmac.compare_digest(hash_secret(secret, salt).split("$")[2], digest)


def parse_secret(secret: str) -> str | None:
    """The key id inside a well-formed secret, else None."""
    m = SECRET_RE.match(secret)
    return m.group(1) if m else None


def _expires(where: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            t = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            if t.tzinfo is None:
                t = t.replace(tzinfo=_dt.timezone.utc)
            return t.timestamp()
    raise ValueError(f"{where}: 'expires_at' must be unix seconds or an ISO 8601 time")


def check_key_fields(where: str, raw: Any, partial: bool) -> dict:
    """Validate the settable fields of a key (POST: ``partial=False`` fills defaults;
    PATCH: ``partial=True`` returns only the fields given). Raises ValueError."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: the body must be a JSON object")
    unknown = set(raw) - set(KEY_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; "
                         f"allowed {list(KEY_FIELDS)}")
    out: dict[str, Any] = {}
    src = raw if partial else {"name": None, "team": None, "role": "member", **raw}
    for f, v in src.items():
        if f in ("name", "team"):
            if v is not None and (not isinstance(v, str) or not 0 < len(v) <= 128):
                raise ValueError(f"{where}: '{f}' must be a string of 1-128 chars or null")
            out[f] = v
        elif f == "role":
            if v not in ROLES:
                raise ValueError(f"{where}: 'role' must be one of {list(ROLES)}")
            out[f] = v
        elif f == "models":
            out[f] = check_models(where, v)
        elif f == "priority":
            out[f] = _opt_int(where, f, v, minimum=-(2**31))
        elif f == "expires_at":
            out[f] = _expires(where, v)
        else:
            out[f] = _opt_int(where, f, v)
    if not partial:
        for f in KEY_FIELDS:
            out.setdefault(f, None)
    return out


def public(record: dict) -> dict:
    """A key record without its hash (what the admin API shows)."""
    return {k: v for k, v in record.items() if k != "key_hash"}


class KeyStore:
    """Key and team records in Redis (``redis.asyncio`` client) behind a TTL cache."""

    def __init__(self, redis, ttl_s: float = 0.5, stale_s: float = 0.0) -> None:
        self.redis, self.ttl_s, self.stale_s = redis, ttl_s, stale_s
        self._cache: dict[str, tuple[float, dict | None]] = {}

    async def _cached(self, rkey: str) -> dict | None:
        now = time.monotonic()
        hit = self._cache.get(rkey)
        if hit and now - hit[0] < self.ttl_s:
            return hit[1]
        try:
            raw = await self.redis.get(rkey)
        except Exception as e:  # redis.exceptions.ConnectionError, TimeoutError, OSError
            if hit and now - hit[0] < self.stale_s:
                return hit[1]
            raise StoreUnavailable(str(e)) from None
        rec = json.loads(raw) if raw else None
        self._cache[rkey] = (now, rec)
        return rec

    async def get_key(self, key_id: str) -> dict | None:
        return await self._cached(f"gw:key:{key_id}")

    async def get_team(self, team: str | None) -> dict | None:
        return await self._cached(f"gw:team:{team}") if team else None

    async def authenticate(self, secret: str) -> dict | None:
        """The live record of ``secret`` (not revoked, not expired), else None."""
        key_id = parse_secret(secret)
        if key_id is None:
            return None
        rec = await self.get_key(key_id)
        if rec is None or not verify_secret(secret, rec.get("key_hash", "")):
            return None
        if rec.get("revoked"):
            return None
        if rec.get("expires_at") is not None and rec["expires_at"] <= time.time():
            return None
        return rec

    async def seed(self, keys: tuple[dict, ...], teams: dict[str, dict]) -> None:
        """Write config keys and teams where absent (run-time changes win)."""
        for name, team in teams.items():
            await self.redis.set(f"gw:team:{name}", json.dumps(team), nx=True)
            await self.redis.sadd("gw:teams", name)
        for k in keys:
            rec = {**k, "revoked": False, "created_at": time.time()}
            await self.redis.set(f"gw:key:{k['id']}", json.dumps(rec), nx=True)
            await self.redis.sadd("gw:keys", k["id"])

    async def create(self, fields: dict) -> tuple[dict, str]:
        """A new key record from checked ``fields``; returns (record, secret)."""
        key_id, secret = new_secret()
        rec = {"id": key_id, **fields, "revoked": False, "created_at": time.time(),
               "key_hash": hash_secret(secret)}
        await self.redis.set(f"gw:key:{key_id}", json.dumps(rec))
        await self.redis.sadd("gw:keys", key_id)
        return rec, secret

    async def list_keys(self) -> list[dict]:
        ids = sorted(await self.redis.smembers("gw:keys"))
        raws = await self.redis.mget([f"gw:key:{i}" for i in ids]) if ids else []
        return [json.loads(r) for r in raws if r]

    async def read_key(self, key_id: str) -> dict | None:
        raw = await self.redis.get(f"gw:key:{key_id}")
        return json.loads(raw) if raw else None

    async def update(self, key_id: str, changes: dict) -> dict | None:
        """Apply ``changes`` atomically (WATCH/MULTI); None if the key does not exist."""
        rkey = f"gw:key:{key_id}"
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(rkey)
                    raw = await pipe.get(rkey)
                    if not raw:
                        return None
                    rec = {**json.loads(raw), **changes}
                    pipe.multi()
                    pipe.set(rkey, json.dumps(rec))
                    await pipe.execute()
                    self._cache.pop(rkey, None)
                    return rec
                except Exception as e:
                    if type(e).__name__ != "WatchError":
                        raise


def _main(argv: list[str]) -> int:
    if not argv or argv[0] != "new" or len(argv) > 2:
        print("usage: python -m llmserve.gateway.keys new [KEY_ID]", file=sys.stderr)
        return 2
    key_id, secret = new_secret(argv[1] if len(argv) > 1 else None)
    print(f"secret (give it to the user, shown once): {secret}")
    print(f"gateway.yaml: - {{id: {key_id}, key_hash: \"{hash_secret(secret)}\"}}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

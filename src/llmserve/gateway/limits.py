"""Rate limits and quotas in Redis: RPM, TPM, parallel requests, daily token quota,
per key and per team, by atomic Lua scripts (no read-modify-write races, so N gateway
replicas on one Redis enforce one limit; the clock is Redis's ``TIME``).

Every limit is checked before work starts and settled when it ends (DESIGN.md s. 8):
:meth:`Limiter.admit` checks all scopes and, only if all pass, reserves in all of
them: one RPM slot, one parallel lease, and ``cost`` tokens (prompt tokens + the most
the request may generate) of TPM and daily quota. :meth:`Limiter.settle` releases the
lease, refunds ``cost - actual`` tokens and records usage.

Redis layout (``P`` = ``gw:lim:key:<id>`` or ``gw:lim:team:<name>``)::

    P:rpm            ZSET  request id -> admission time; sliding 60 s window
    P:par            ZSET  request id -> lease expiry (a crashed gateway's leases lapse)
    P:tpm            HASH  unix second -> tokens reserved in it; the last 60 seconds
    P:quota:<day>    STR   tokens charged on that UTC day (day = unix s // 86400)
    gw:usage:key:<id>:<YYYY-MM-DD>, gw:usage:team:<name>:<YYYY-MM-DD>
                     HASH  "<model>|requests|prompt_tokens|completion_tokens" counters

Key names are built inside the scripts, so this needs a single Redis (not Redis Cluster).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ADMIT_LUA = """
local t = redis.call('TIME')
local sec = tonumber(t[1])
local now = sec + tonumber(t[2]) / 1000000
local day = math.floor(sec / 86400)
local rid, cost, lease, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
for i = 0, n - 1 do
  local b = 5 + i * 5
  local p = ARGV[b]
  local rpm, tpm = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local par, quota = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
  if rpm >= 0 then
    local k = p .. ':rpm'
    redis.call('ZREMRANGEBYSCORE', k, '-inf', now - 60)
    if redis.call('ZCARD', k) >= rpm then
      local oldest = redis.call('ZRANGE', k, 0, 0, 'WITHSCORES')
      local retry = 60
      if oldest[2] then retry = tonumber(oldest[2]) + 60 - now end
      return {0, 'rpm', p, tostring(retry)}
    end
  end
  if par >= 0 then
    local k = p .. ':par'
    redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
    if redis.call('ZCARD', k) >= par then return {0, 'parallel', p, '1'} end
  end
  if tpm >= 0 then
    if cost > tpm then return {0, 'tpm_request_too_large', p, '60'} end
    local k = p .. ':tpm'
    local all = redis.call('HGETALL', k)
    local used, buckets = 0, {}
    for j = 1, #all, 2 do
      local s, v = tonumber(all[j]), tonumber(all[j + 1])
      if s <= sec - 60 then redis.call('HDEL', k, all[j])
      else used = used + v; table.insert(buckets, {s, v}) end
    end
    if used + cost > tpm then
      table.sort(buckets, function(x, y) return x[1] < y[1] end)
      local need, retry = used + cost - tpm, 60
      for _, bk in ipairs(buckets) do
        need = need - bk[2]
        if need <= 0 then retry = bk[1] + 60 - now; break end
      end
      return {0, 'tpm', p, tostring(retry)}
    end
  end
  if quota >= 0 then
    local used = tonumber(redis.call('GET', p .. ':quota:' .. day) or '0')
    if cost > quota - used then
      return {0, 'daily_token_quota', p, tostring((day + 1) * 86400 - now)}
    end
  end
end
for i = 0, n - 1 do
  local b = 5 + i * 5
  local p = ARGV[b]
  if tonumber(ARGV[b + 1]) >= 0 then redis.call('ZADD', p .. ':rpm', now, rid)
    redis.call('EXPIRE', p .. ':rpm', 120) end
  if tonumber(ARGV[b + 3]) >= 0 then redis.call('ZADD', p .. ':par', now + lease, rid)
    redis.call('EXPIRE', p .. ':par', math.ceil(lease) + 60) end
  if tonumber(ARGV[b + 2]) >= 0 and cost > 0 then
    redis.call('HINCRBY', p .. ':tpm', sec, cost)
    redis.call('EXPIRE', p .. ':tpm', 120) end
  if tonumber(ARGV[b + 4]) >= 0 and cost > 0 then
    redis.call('INCRBY', p .. ':quota:' .. day, cost)
    redis.call('EXPIRE', p .. ':quota:' .. day, 172800) end
end
return {1, tostring(sec), tostring(day)}
"""

# ARGV: rid, sec, day, refund, n, usage_date, model, prompt, completion,
#       then per scope: prefix, had_parallel, had_tpm, had_quota, usage_key
SETTLE_LUA = """
local rid, sec, day, refund, n = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local date, model, pt, ct = ARGV[6], ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9])
for i = 0, n - 1 do
  local b = 10 + i * 5
  local p = ARGV[b]
  if ARGV[b + 1] == '1' then redis.call('ZREM', p .. ':par', rid) end
  if refund ~= 0 and ARGV[b + 2] == '1' then
    local k = p .. ':tpm'
    if redis.call('HEXISTS', k, sec) == 1 then
      if redis.call('HINCRBY', k, sec, -refund) < 0 then redis.call('HSET', k, sec, 0) end
    end
  end
  if refund ~= 0 and ARGV[b + 3] == '1' then
    local k = p .. ':quota:' .. day
    if redis.call('EXISTS', k) == 1 then
      if redis.call('INCRBY', k, -refund) < 0 then redis.call('SET', k, 0, 'KEEPTTL') end
    end
  end
  if ARGV[b + 4] ~= '' then
    local u = ARGV[b + 4] .. ':' .. date
    redis.call('HINCRBY', u, model .. '|requests', 1)
    redis.call('HINCRBY', u, model .. '|prompt_tokens', pt)
    redis.call('HINCRBY', u, model .. '|completion_tokens', ct)
  end
end
return 1
"""


@dataclass(frozen=True)
class Scope:
    """One limited subject (a key or a team). Limits: None = unlimited."""

    prefix: str  # gw:lim:key:<id> | gw:lim:team:<name>
    usage_key: str  # gw:usage:key:<id> | gw:usage:team:<name>
    rpm: int | None = None
    tpm: int | None = None
    parallel: int | None = None
    quota: int | None = None

    @classmethod
    def of(cls, kind: str, name: str, rec: dict) -> Scope:
        return cls(f"gw:lim:{kind}:{name}", f"gw:usage:{kind}:{name}", rec.get("rpm"),
                   rec.get("tpm"), rec.get("max_parallel_requests"),
                   rec.get("daily_token_quota"))

    def kinds(self) -> set[str]:
        return {k for k, v in (("rpm", self.rpm), ("tpm", self.tpm),
                               ("parallel", self.parallel), ("quota", self.quota))
                if v is not None}


class RateLimited(Exception):
    """Over a limit: ``kind`` (rpm, tpm, parallel, daily_token_quota,
    tpm_request_too_large), the scope prefix, and seconds until a retry can pass."""

    def __init__(self, kind: str, prefix: str, retry_after: float) -> None:
        self.kind, self.prefix = kind, prefix
        self.retry_after = max(1, math.ceil(retry_after))
        who = prefix.split(":", 2)[-1].replace(":", " ", 1)
        super().__init__(f"rate limit exceeded: {kind} of {who}; retry after "
                         f"{self.retry_after} s")


class LimitsUnavailable(Exception):
    """Redis unreachable and some applicable limit fails closed."""


@dataclass
class Reservation:
    request_id: str
    scopes: list[Scope]
    cost: int
    sec: str = "0"
    day: str = "0"
    held: bool = False  # False when admitted fail-open without Redis
    settled: bool = field(default=False)


class Limiter:
    """Runs the admission and settlement scripts on a ``redis.asyncio`` client."""

    def __init__(self, redis, fail_open: dict[str, bool], lease_s: float = 900.0) -> None:
        self.redis, self.fail_open, self.lease_s = redis, fail_open, lease_s
        self._admit = redis.register_script(ADMIT_LUA)
        self._settle = redis.register_script(SETTLE_LUA)

    async def admit(self, request_id: str, scopes: list[Scope], cost: int) -> Reservation:
        """Check every scope, then reserve in all of them, atomically. Raises
        :class:`RateLimited` or :class:`LimitsUnavailable` (Redis down, fail closed)."""
        res = Reservation(request_id, scopes, cost)
        argv: list = [request_id, cost, self.lease_s, len(scopes)]
        for s in scopes:
            argv += [s.prefix, *(-1 if v is None else v for v in (s.rpm, s.tpm, s.parallel,
                                                                  s.quota))]
        try:
            out = await self._admit(keys=[], args=argv)
        except Exception as e:
            if type(e).__name__ == "NoScriptError":
                raise
            kinds = set().union(*(s.kinds() for s in scopes)) if scopes else set()
            closed = sorted(k for k in kinds if not self.fail_open.get(k, False))
            if closed:
                raise LimitsUnavailable(
                    f"rate-limit store (Redis) unreachable; limits {closed} fail closed"
                ) from None
            logger.warning("Redis unreachable; admitting %s fail-open", request_id)
            return res
        if int(out[0]) != 1:
            raise RateLimited(_s(out[1]), _s(out[2]), float(_s(out[3])))
        res.sec, res.day, res.held = _s(out[1]), _s(out[2]), True
        return res

    async def settle(self, res: Reservation, model: str, prompt_tokens: int,
                     completion_tokens: int) -> None:
        """Release the lease, refund ``cost - actual`` tokens, count usage. Never raises
        (the response is already out); an error is logged."""
        if res.settled:
            return
        res.settled = True
        refund = res.cost - (prompt_tokens + completion_tokens) if res.cost else 0
        date = time.strftime("%Y-%m-%d", time.gmtime())
        argv: list = [res.request_id, res.sec, res.day, refund if res.held else 0,
                      len(res.scopes), date, model, prompt_tokens, completion_tokens]
        for s in res.scopes:
            argv += [s.prefix, int(res.held and s.parallel is not None),
                     int(res.held and s.tpm is not None),
                     int(res.held and s.quota is not None), s.usage_key]
        try:
            await self._settle(keys=[], args=argv)
        except Exception:
            logger.exception("settling request %s failed", res.request_id)

    async def window(self, scope: Scope) -> dict:
        """Current use of a scope: requests and tokens in the last 60 s, parallel
        requests in flight, tokens charged today (UTC)."""
        sec, usec = await self.redis.time()
        now = sec + usec / 1e6
        p = scope.prefix
        rpm = await self.redis.zcount(p + ":rpm", now - 60, "+inf")
        par = await self.redis.zcount(p + ":par", now, "+inf")
        buckets = await self.redis.hgetall(p + ":tpm")
        tpm = sum(int(v) for s, v in buckets.items() if int(s) > sec - 60)
        quota = int(await self.redis.get(f"{p}:quota:{sec // 86400}") or 0)
        return {"requests_last_minute": rpm, "tokens_last_minute": tpm,
                "parallel_requests": par, "tokens_today": quota}


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)

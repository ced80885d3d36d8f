"""The atomic Lua scripts of :mod:`llmserve.router.redis_state` and its key layout.

Keys (``P`` = the key prefix, default ``llmserve:router:``; ``{id}`` a worker id,
``{rid}`` a router replica id)::

    P workers          hash   id -> url               membership
    P urls             hash   url -> id               (one id per url)
    P draining         set    ids being drained       (removed once P load[id] is 0)
    P version          int    bumped on every membership change (replicas poll it)
    P next_id          int    allocates w0, w1, ...
    P load             hash   id -> in-flight requests over all replicas
    P inflight:{rid}   hash   id -> what replica rid reserved (reclaimed if it dies)
    P replicas         set    replica ids;  P hb:{rid}  string, PX heartbeat TTL
    P down:{id}        string "unhealthy" | "breaker", PX TTL (refreshed while down)
    P blocks:{id}      zset   block hash -> ms it was routed there (assumed cached)
    P digest:{id}      set    block hashes the worker published (GET /kv_cache/digest)
    P digest_version:{id}     that digest's version
    P session:{key}    string worker id, EX session TTL (header / OpenAI ``user``)
    P rr               int    the round-robin counter

Every script takes the prefix as ``ARGV[1]`` and builds its keys from it (one Redis,
not a cluster). Times are wall-clock milliseconds from the calling replica.
"""

# a worker leaves: membership, load, cache view (sessions expire on their own)
_REMOVE = """
local function remove_worker(P, id)
  local url = redis.call('HGET', P..'workers', id)
  if url then redis.call('HDEL', P..'urls', url) end
  redis.call('HDEL', P..'workers', id)
  redis.call('SREM', P..'draining', id)
  redis.call('HDEL', P..'load', id)
  redis.call('DEL', P..'blocks:'..id, P..'digest:'..id, P..'digest_version:'..id,
             P..'down:'..id)
  redis.call('INCR', P..'version')
end
"""

# ARGV: P, url, wanted id ("" = allocate) -> {status, id}; status ok | url | id
ADD = """
local P, url, id = ARGV[1], ARGV[2], ARGV[3]
local have = redis.call('HGET', P..'urls', url)
if have then return {'url', have} end
if id == '' then
  repeat
    id = 'w'..(redis.call('INCR', P..'next_id') - 1)
  until redis.call('HEXISTS', P..'workers', id) == 0
elseif redis.call('HEXISTS', P..'workers', id) == 1 then
  return {'id', id}
end
redis.call('HSET', P..'workers', id, url)
redis.call('HSET', P..'urls', url, id)
redis.call('INCR', P..'version')
return {'ok', id}
"""

# ARGV: P, id -> -1 no such worker, 0 draining, 1 removed (it was idle)
DRAIN = _REMOVE + """
local P, id = ARGV[1], ARGV[2]
if redis.call('HEXISTS', P..'workers', id) == 0 then return -1 end
if tonumber(redis.call('HGET', P..'load', id) or '0') <= 0 then
  remove_worker(P, id)
  return 1
end
redis.call('SADD', P..'draining', id)
redis.call('INCR', P..'version')
return 0
"""

# ARGV: P, session ("" none), want_seq (0/1), n, then n x (id, k, k hashes)
# -> {session worker or "", seq or -1, then n x (load, matched blocks)}
PREPARE = """
local P = ARGV[1]
local out = {'', -1}
if ARGV[2] ~= '' then out[1] = redis.call('GET', P..'session:'..ARGV[2]) or '' end
if ARGV[3] == '1' then out[2] = redis.call('INCR', P..'rr') - 1 end
local i = 5
for w = 1, tonumber(ARGV[4]) do
  local id, k = ARGV[i], tonumber(ARGV[i + 1])
  i = i + 2
  local n, open = 0, true
  for j = 0, k - 1 do
    local h = ARGV[i + j]
    if open and (redis.call('ZSCORE', P..'blocks:'..id, h)
                 or redis.call('SISMEMBER', P..'digest:'..id, h) == 1) then
      n = n + 1
    else
      open = false
    end
  end
  i = i + k
  out[#out + 1] = tonumber(redis.call('HGET', P..'load', id) or '0')
  out[#out + 1] = n
end
return out
"""

# ARGV: P, rid, id, now_ms, max_blocks, session ("" none), session_ttl_s, hashes...
# -> the worker's new load
DISPATCH = """
local P, rid, id = ARGV[1], ARGV[2], ARGV[3]
local load = redis.call('HINCRBY', P..'load', id, 1)
redis.call('HINCRBY', P..'inflight:'..rid, id, 1)
redis.call('SADD', P..'replicas', rid)
if #ARGV > 7 then
  local key = P..'blocks:'..id
  for j = 8, #ARGV do redis.call('ZADD', key, ARGV[4], ARGV[j]) end
  local extra = redis.call('ZCARD', key) - tonumber(ARGV[5])
  if extra > 0 then redis.call('ZREMRANGEBYRANK', key, 0, extra - 1) end
end
if ARGV[6] ~= '' then
  redis.call('SET', P..'session:'..ARGV[6], id, 'EX', ARGV[7])
end
return load
"""

# ARGV: P, rid, id -> {load, removed 0/1}; refunds only what rid reserved
FINISH = _REMOVE + """
local P, rid, id = ARGV[1], ARGV[2], ARGV[3]
local mine = tonumber(redis.call('HGET', P..'inflight:'..rid, id) or '0')
if mine > 0 then
  redis.call('HINCRBY', P..'inflight:'..rid, id, -1)
  if redis.call('HINCRBY', P..'load', id, -1) < 0 then redis.call('HSET', P..'load', id, 0) end
end
local load = tonumber(redis.call('HGET', P..'load', id) or '0')
if load <= 0 and redis.call('SISMEMBER', P..'draining', id) == 1 then
  remove_worker(P, id)
  return {0, 1}
end
return {load, 0}
"""

# ARGV: P, id, version, asked_at_ms, hashes... -> 1 stored, 0 already had it
DIGEST = """
local P, id = ARGV[1], ARGV[2]
if redis.call('HEXISTS', P..'workers', id) == 0 then return 0 end
if redis.call('GET', P..'digest_version:'..id) == ARGV[3] then return 0 end
redis.call('DEL', P..'digest:'..id)
for j = 5, #ARGV, 1000 do
  redis.call('SADD', P..'digest:'..id, unpack(ARGV, j, math.min(j + 999, #ARGV)))
end
redis.call('SET', P..'digest_version:'..id, ARGV[3])
redis.call('ZREMRANGEBYSCORE', P..'blocks:'..id, '-inf', '(' .. ARGV[4])
return 1
"""

# ARGV: P -> replicas reclaimed. A replica whose heartbeat expired gives back what it
# reserved; drained workers that became idle leave.
JANITOR = _REMOVE + """
local P = ARGV[1]
local dead = 0
for _, rid in ipairs(redis.call('SMEMBERS', P..'replicas')) do
  if redis.call('EXISTS', P..'hb:'..rid) == 0 then
    local held = redis.call('HGETALL', P..'inflight:'..rid)
    for j = 1, #held, 2 do
      if redis.call('HINCRBY', P..'load', held[j], -tonumber(held[j + 1])) < 0 then
        redis.call('HSET', P..'load', held[j], 0)
      end
    end
    redis.call('DEL', P..'inflight:'..rid)
    redis.call('SREM', P..'replicas', rid)
    dead = dead + 1
  end
end
for _, id in ipairs(redis.call('SMEMBERS', P..'draining')) do
  if tonumber(redis.call('HGET', P..'load', id) or '0') <= 0 then remove_worker(P, id) end
end
return dead
"""

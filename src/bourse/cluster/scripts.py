"""The Lua scripts of the Redis book and rate limiter.

Each script runs atomically inside Redis, so admission across replicas needs no
lock and no consensus of our own: the best waiting order (bid, then arrival) is
matched to the cheapest free eligible slot in one step, and a slot is counted
busy exactly while one order holds it.

Keys of one product (``{prefix}:{product}`` is a hash tag: one cluster slot):

- ``book``   ZSET  member ``%016d(seq):order_id``, score ``-bid`` (equal scores
  sort by member, so by arrival)
- ``orders`` HASH  order_id -> ``member|bid|avoid|replica|attempt`` (waiting orders)
- ``held``   HASH  order_id -> ``deployment|replica|price|level|attempt`` (slots given;
  ``attempt`` tells a requeued order's admissions apart)
- ``lease``  ZSET  order_id -> lease expiry (ms); renewed by the owner's heartbeat
- ``busy``   HASH  deployment -> slots in use
- ``cool``   HASH  deployment -> cooling until (ms), set by a replica's breaker
- ``stats``  HASH  ``admitted`` -> admissions ever
- ``recent`` LIST  ``ms|price|bid|deployment``, newest first, 32 kept
- ``seq``    STRING arrival counter

and ``{prefix}:replicas`` (ZSET replica -> lease expiry, ms): an order whose replica
is gone is dropped rather than admitted.

Numbers that are prices travel as strings (``repr`` of a float in, ``%.17g`` out)
so no precision is lost; the cleared price is always one of the bid, a floor or
the runner-up's bid, never computed.
"""

from __future__ import annotations

BOOK_KEYS = ("book", "orders", "held", "lease", "busy", "cool", "stats", "recent", "seq")

_COMMON = r"""
local book, orders, held, lease, busy, cool, stats, recent, seqk, reps =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local deps = cjson.decode(ARGV[1])   -- {{name, floor(string), slots}, ...}
local lease_ms = tonumber(ARGV[2])
local chan = ARGV[3]
local product = ARGV[4]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function fmt(x) return string.format('%.17g', x) end
local quiet = ''   -- an order whose admission the caller reads from the reply (no message)

local function split(s)
  local out = {}
  for part in string.gmatch(s .. '|', '([^|]*)|') do out[#out + 1] = part end
  return out
end

local function busy_of(name) return tonumber(redis.call('HGET', busy, name) or '0') end
local function cool_of(name) return tonumber(redis.call('HGET', cool, name) or '0') end

local function cool_until(name, t)
  -- a replica's breaker opened: no clear uses ``name`` before ``t`` (ms)
  if t > 0 and t > cool_of(name) then redis.call('HSET', cool, name, t) end
end

local function free_slot(name)
  local b = redis.call('HINCRBY', busy, name, -1)
  if b < 0 then redis.call('HSET', busy, name, 0) end
end

local function drop(oid)
  -- take oid out of the book, or give back the slot it holds
  local h = redis.call('HGET', held, oid)
  if h then
    free_slot(split(h)[1])
    redis.call('HDEL', held, oid)
  end
  local o = redis.call('HGET', orders, oid)
  if o then
    redis.call('ZREM', book, split(o)[1])
    redis.call('HDEL', orders, oid)
  end
  redis.call('ZREM', lease, oid)
  return h, o
end

local function prune()
  local expired = redis.call('ZRANGEBYSCORE', lease, '-inf', now, 'LIMIT', 0, 512)
  for _, oid in ipairs(expired) do drop(oid) end
end

local function level()
  local top = redis.call('ZRANGE', book, 0, 0, 'WITHSCORES')
  local minf, minf_s, freef, freef_s = nil, nil, nil, nil
  for _, d in ipairs(deps) do
    local f = tonumber(d[2])
    if minf == nil or f < minf then minf, minf_s = f, d[2] end
    if busy_of(d[1]) < d[3] and cool_of(d[1]) <= now then
      if freef == nil or f < freef then freef, freef_s = f, d[2] end
    end
  end
  if #top == 0 then
    if freef then return freef_s end
    return minf_s
  end
  local best = -tonumber(top[2])
  if best >= minf then return fmt(best) end
  return minf_s
end

local function dispatch()
  local n = 0
  while true do
    local top = redis.call('ZRANGE', book, 0, 0, 'WITHSCORES')
    if #top == 0 then break end
    local member = top[1]
    local oid = string.sub(member, 18)
    local raw = redis.call('HGET', orders, oid)
    local o = split(raw or (member .. '|0||'))
    local bid_s, avoid, replica, attempt = o[2], o[3], o[4], o[5] or '0'
    local bid = tonumber(bid_s)
    local best, k1, k2, k3, floor_s = nil, 0, 0, 0, nil
    if not raw then
      redis.call('ZREM', book, member)   -- never left stranded
    else
      local alive = redis.call('ZSCORE', reps, replica)
      if not alive or tonumber(alive) < now then
        drop(oid)   -- its replica is gone: nobody would run it
        raw = false
      end
    end
    for _, d in ipairs(raw and deps or {}) do
      local name, f = d[1], tonumber(d[2])
      local b = busy_of(name)
      if b < d[3] and f <= bid and cool_of(name) <= now then
        local a = (name == avoid) and 1 or 0
        if best == nil or a < k1 or (a == k1 and (f < k2 or (f == k2 and b < k3))) then
          best, k1, k2, k3, floor_s = name, a, f, b, d[2]
        end
      end
    end
    if best == nil then
      if raw then break end
    else
    redis.call('ZREM', book, member)
    redis.call('HDEL', orders, oid)
    redis.call('HINCRBY', busy, best, 1)
    local nxt = redis.call('ZRANGE', book, 0, 0, 'WITHSCORES')
    local runner = 0
    if #nxt > 0 then runner = -tonumber(nxt[2]) end
    local floor = tonumber(floor_s)
    local price_s
    if bid <= floor or bid <= runner then price_s = bid_s
    elseif floor >= runner then price_s = floor_s
    else price_s = fmt(runner) end
    local lvl = level()
    redis.call('HSET', held, oid, best .. '|' .. replica .. '|' .. price_s .. '|' .. lvl .. '|' .. attempt)
    redis.call('ZADD', lease, now + lease_ms, oid)
    redis.call('HINCRBY', stats, 'admitted', 1)
    redis.call('LPUSH', recent, now .. '|' .. price_s .. '|' .. bid_s .. '|' .. best)
    redis.call('LTRIM', recent, 0, 31)
    if oid ~= quiet then
      redis.call('PUBLISH', chan .. replica,
        product .. '|' .. oid .. '|' .. best .. '|' .. price_s .. '|' .. lvl .. '|' .. attempt)
    end
    n = n + 1
    end
  end
  return n
end
"""

SUBMIT = (
    _COMMON
    + r"""
-- ARGV[5..12]: order_id, bid, seq (0: new), avoid, replica, max_waiting, cool_until (ms, 0: no), attempt
-- A requeue is a submit of an order that holds a slot: the slot is given back and
-- the order rests again with its arrival in the same step, so no later order of
-- equal bid can take its place in between.
local oid, bid_s, seq, avoid, replica = ARGV[5], ARGV[6], tonumber(ARGV[7]), ARGV[8], ARGV[9]
local h = redis.call('HGET', held, oid)
if h then cool_until(split(h)[1], tonumber(ARGV[11] or '0')) end
drop(oid)   -- the slot of a requeued order, or an earlier life of it (a job resumed after a crash)
prune()
if redis.call('ZCARD', book) >= tonumber(ARGV[10]) then
  dispatch()   -- a requeued order gave its slot back
  return {'full'}
end
if seq == 0 then seq = redis.call('INCR', seqk) end
local member = string.format('%016d', seq) .. ':' .. oid
redis.call('ZADD', book, '-' .. bid_s, member)
redis.call('HSET', orders, oid, member .. '|' .. bid_s .. '|' .. avoid .. '|' .. replica .. '|' .. (ARGV[12] or '0'))
redis.call('ZADD', lease, now + lease_ms, oid)
local pos = redis.call('ZRANK', book, member)
quiet = oid
dispatch()
local rank = redis.call('ZRANK', book, member)
return {'ok', seq, pos, redis.call('HGET', held, oid) or '', rank or -1, level(), redis.call('ZCARD', book)}
"""
)

REMOVE = (
    _COMMON
    + r"""
-- ARGV[5]: order_id. Takes a waiting order out; tells if it was admitted meanwhile.
local oid = ARGV[5]
local o = redis.call('HGET', orders, oid)
if o then
  drop(oid)
  prune()
  dispatch()
  return {'removed'}
end
local h = redis.call('HGET', held, oid)
if h then return {'held', h} end
return {'gone'}
"""
)

RELEASE = (
    _COMMON
    + r"""
-- ARGV[5]: order_id. Gives its slot back (a no-op if its lease already did).
local oid = ARGV[5]
local h = redis.call('HGET', held, oid)
if h then drop(oid) end
prune()
dispatch()
if h then return 1 end
return 0
"""
)

COOL = (
    _COMMON
    + r"""
-- ARGV[5]: deployment; ARGV[6]: until (ms; 0 clears the cooling)
local dep, untilms = ARGV[5], tonumber(ARGV[6])
if untilms == 0 then
  redis.call('HDEL', cool, dep)
else
  cool_until(dep, untilms)
end
prune()
dispatch()
return 1
"""
)

HEARTBEAT = (
    _COMMON
    + r"""
-- ARGV[5..]: the order ids this replica waits on or holds: renew their leases,
-- clear the book, and report each one ('w' rank | 'h' terms | 'g' gone)
for i = 5, #ARGV do
  if redis.call('ZSCORE', lease, ARGV[i]) then redis.call('ZADD', lease, now + lease_ms, ARGV[i]) end
end
prune()
dispatch()
local out = {level(), redis.call('ZCARD', book)}
for i = 5, #ARGV do
  local oid = ARGV[i]
  local o = redis.call('HGET', orders, oid)
  if o then
    out[#out + 1] = 'w' .. (redis.call('ZRANK', book, split(o)[1]) or -1)
  else
    local h = redis.call('HGET', held, oid)
    if h then out[#out + 1] = 'h' .. h else out[#out + 1] = 'g' end
  end
end
return out
"""
)

STANDING = (
    _COMMON
    + r"""
-- ARGV[5]: a book member ('' for none): the level and the orders ahead of it
local rank = -1
if ARGV[5] ~= '' then rank = redis.call('ZRANK', book, ARGV[5]) or -1 end
return {level(), rank}
"""
)

VIEW = (
    _COMMON
    + r"""
-- ARGV[5]: how many waiting bids to list
prune()
dispatch()
local out = {level(), redis.call('ZCARD', book), redis.call('HGET', stats, 'admitted') or '0'}
local b, c = {}, {}
for _, d in ipairs(deps) do
  b[#b + 1] = tostring(busy_of(d[1]))
  c[#c + 1] = tostring(cool_of(d[1]) - now)
end
out[4] = b
out[5] = c
local bids = {}
local top = redis.call('ZRANGE', book, 0, tonumber(ARGV[5]) - 1, 'WITHSCORES')
for i = 2, #top, 2 do bids[#bids + 1] = fmt(-tonumber(top[i])) end
out[6] = bids
out[7] = redis.call('LRANGE', recent, 0, 31)
out[8] = tostring(now)
return out
"""
)

RATE_ACQUIRE = r"""
-- KEYS: bucket hash, streams hash (replica -> count), replicas zset (replica -> lease ms)
-- ARGV: rpm, tpm, max_streams (-1: none), tokens, replica, ttl_ms
local k, sk, reps = KEYS[1], KEYS[2], KEYS[3]
local rpm, tpm, maxs, tokens, replica, ttl =
  tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local t = redis.call('TIME')
local nowms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now = nowms / 1000
local function fmt(x) return string.format('%.6f', x) end

local streams = 0
local all = redis.call('HGETALL', sk)
for i = 1, #all, 2 do
  local exp = redis.call('ZSCORE', reps, all[i])
  if exp and tonumber(exp) > nowms then
    streams = streams + tonumber(all[i + 1])
  else
    redis.call('HDEL', sk, all[i])   -- a replica that died holding streams
  end
end
if maxs >= 0 and streams >= maxs then return {0, 'streams', fmt(1), tostring(streams)} end

local function bucket(prefix, cap)
  local lv = tonumber(redis.call('HGET', k, prefix .. 'l') or '-1')
  local at = tonumber(redis.call('HGET', k, prefix .. 'a') or '0')
  local c = tonumber(redis.call('HGET', k, prefix .. 'c') or '-1')
  if lv < 0 or c ~= cap then return cap end
  if now > at then lv = math.min(cap, lv + (now - at) * cap / 60) end
  return lv
end

local rq, tk = nil, nil
if rpm >= 0 then
  rq = bucket('r', rpm)
  if rq < 1 then return {0, 'requests', fmt((1 - rq) * 60 / rpm), fmt(rq)} end
end
local need = 0
if tpm >= 0 then
  tk = bucket('t', tpm)
  need = math.min(tokens, tpm)
  if tk < need then return {0, 'tokens', fmt((need - tk) * 60 / tpm), fmt(tk)} end
end
if rq then
  rq = rq - 1
  redis.call('HSET', k, 'rl', fmt(rq), 'ra', fmt(now), 'rc', rpm)
end
if tk then
  tk = tk - need
  redis.call('HSET', k, 'tl', fmt(tk), 'ta', fmt(now), 'tc', tpm)
end
redis.call('PEXPIRE', k, ttl)
redis.call('HINCRBY', sk, replica, 1)
redis.call('PEXPIRE', sk, 86400000)
return {1, '', fmt(rq or -1), fmt(tk or -1)}
"""

RATE_FINISH = r"""
-- KEYS: bucket hash, streams hash. ARGV: tpm (-1: none), tokens to give back, replica
local k, sk = KEYS[1], KEYS[2]
local tpm, back, replica = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local n = redis.call('HINCRBY', sk, replica, -1)
if n <= 0 then redis.call('HDEL', sk, replica) end
if tpm >= 0 and back > 0 then
  local lv = tonumber(redis.call('HGET', k, 'tl') or '-1')
  local c = tonumber(redis.call('HGET', k, 'tc') or '-1')
  if lv >= 0 and c == tpm then
    redis.call('HSET', k, 'tl', string.format('%.6f', math.min(tpm, lv + back)))
  end
end
return 1
"""

ALL = {
    "SUBMIT": SUBMIT,
    "REMOVE": REMOVE,
    "RELEASE": RELEASE,
    "COOL": COOL,
    "HEARTBEAT": HEARTBEAT,
    "STANDING": STANDING,
    "VIEW": VIEW,
    "RATE_ACQUIRE": RATE_ACQUIRE,
    "RATE_FINISH": RATE_FINISH,
}
"""Every script by name, as the hub registers them."""

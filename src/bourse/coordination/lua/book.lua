-- The shared part of every book script (bourse.coordination.book_redis): each
-- book_*.lua is run as this file followed by its own text.
--
-- Each script runs atomically inside Redis, so admission across replicas needs no
-- lock and no consensus of our own: the best waiting order (bid, then arrival) is
-- matched to the cheapest free eligible slot in one step, and a slot is counted
-- busy exactly while one order holds it.
--
-- Keys of one product ({prefix}:{product} is a hash tag: one cluster slot), in
-- KEYS order (book_redis.BOOK_KEYS):
--
--   book    ZSET   member '%016d(seq):order_id', score -bid (equal scores sort
--                  by member, so by arrival): the orders that may be admitted
--   orders  HASH   order_id -> 'member|bid|avoid|replica|attempt|cap' (waiting orders,
--                  in the book or parked; cap: its output cap, '' if not known)
--   held    HASH   order_id -> 'deployment|replica|price|level|attempt|bid|cap' (slots
--                  given; attempt tells a requeued order's admissions apart; bid is
--                  the one it cleared at, a raised deadline order's included; cap as
--                  in orders: the wait forecast reads it, VIEW)
--   lease   ZSET   order_id -> lease expiry (ms); renewed by the owner's heartbeat
--   busy    HASH   deployment -> slots in use
--   cool    HASH   deployment -> cooling until (ms, Redis's clock), set by a replica's breaker
--   stats   HASH   'admitted' -> admissions ever; 'swept' -> last sweep of parked orders (ms)
--   recent  LIST   'ms|price|bid|deployment|order_id|attempt', newest first, 32 kept;
--                  '|x' appended marks a failed attempt (FAILED: its run ended before
--                  any output; no clear)
--   seq     STRING arrival counter (at least the arrival time in µs, so arrivals stay
--                  ordered across a Redis restart)
--   offer   HASH   order_id -> 'orders entry#recent entry': an admission published to
--                  its replica and not yet taken up (its lease is the take-up deadline)
--   park    ZSET   as book: waiting orders of a replica that went silent or missed a
--                  take-up; their place is kept, nothing admits them
--   parkn   HASH   replica -> its orders in park
--   stall   HASH   replica -> when it missed a take-up (ms); cleared when it speaks
--
-- and {prefix}:replicas (ZSET replica -> lease expiry, ms). A replica that calls any
-- script is alive: its entry is renewed, its stall mark cleared and its parked
-- orders go back to their place in the book in the same step. A parked order is
-- dropped once its replica has been silent for park_ms past its lease (presumed
-- dead); its owner, if it comes back later, rests it again with its arrival.
--
-- Numbers that are prices travel as strings (repr of a float in, %.17g out) so no
-- precision is lost; the cleared price is always one of the bid, a floor or the
-- runner-up's bid, never computed.
--
-- ARGV[1..7] (every book script): deployments as JSON, lease (ms), the admission
-- channel prefix, the product, the calling replica, the take-up deadline (ms), the
-- park limit (ms); the script's own arguments follow from ARGV[A] (A = 8). Every
-- script returns {offers, reply}: offers = admissions it published (the caller
-- sweeps once their take-up deadline has passed).

local book, orders, held, lease, busy, cool, stats, recent, seqk, offer, park, parkn, stall, reps =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11],
  KEYS[12], KEYS[13], KEYS[14]
local deps = cjson.decode(ARGV[1])   -- {{name, floor(string), slots}, ...}
local lease_ms = tonumber(ARGV[2])
local chan = ARGV[3]
local product = ARGV[4]
local caller = ARGV[5]
local take_ms = tonumber(ARGV[6])
local park_ms = tonumber(ARGV[7])
local A = 8
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local offers = 0

local function fmt(x) return string.format('%.17g', x) end
local function out(reply) return {offers, reply} end
local quiet = ''   -- an order whose admission the caller reads from the reply (no message)

local function split(s)
  local parts = {}
  for part in string.gmatch(s .. '|', '([^|]*)|') do parts[#parts + 1] = part end
  return parts
end

local function busy_of(name) return tonumber(redis.call('HGET', busy, name) or '0') end
local function cool_of(name) return tonumber(redis.call('HGET', cool, name) or '0') end

local function cool_for(name, for_ms)
  -- a replica's breaker opened: no clear uses ``name`` for ``for_ms`` from now, on
  -- Redis's clock (a replica sends a duration, never its own clock's time)
  local until_ms = now + for_ms
  if for_ms > 0 and until_ms > cool_of(name) then redis.call('HSET', cool, name, until_ms) end
end

local function free_slot(name)
  local b = redis.call('HINCRBY', busy, name, -1)
  if b < 0 then redis.call('HSET', busy, name, 0) end
end

local function next_seq()
  -- strictly increasing, and at least the time in µs: an order rested after a Redis
  -- restart arrives after the orders its replicas rest again with their arrival
  local s = redis.call('INCR', seqk)
  local floor_us = now * 1000
  if s < floor_us then
    s = floor_us
    redis.call('SET', seqk, string.format('%d', s))
  end
  return s
end

local function park_order(oid, member, score, replica)
  redis.call('ZREM', book, member)
  if redis.call('ZADD', park, score, member) == 1 then redis.call('HINCRBY', parkn, replica, 1) end
  redis.call('ZREM', lease, oid)
end

local function drop(oid)
  -- take oid out of the book (or out of park), or give back the slot it holds
  local h = redis.call('HGET', held, oid)
  if h then
    free_slot(split(h)[1])
    redis.call('HDEL', held, oid)
    redis.call('HDEL', offer, oid)
  end
  local o = redis.call('HGET', orders, oid)
  if o then
    local f = split(o)
    redis.call('ZREM', book, f[1])
    if redis.call('ZREM', park, f[1]) == 1 then
      if redis.call('HINCRBY', parkn, f[4], -1) <= 0 then redis.call('HDEL', parkn, f[4]) end
    end
    redis.call('HDEL', orders, oid)
  end
  redis.call('ZREM', lease, oid)
  return h, o
end

local function undo_offer(oid, off)
  -- an offer not taken up: its slot is free again and it was no admission
  local entry, rec = string.match(off, '^(.*)#(.*)$')
  local h = redis.call('HGET', held, oid)
  if h then free_slot(split(h)[1]) end
  redis.call('HDEL', held, oid)
  redis.call('HDEL', offer, oid)
  redis.call('HINCRBY', stats, 'admitted', -1)
  redis.call('LREM', recent, 1, rec)
  return entry
end

local function give_back(oid, off)
  -- an admission not taken up in time: undone, and the order waits again with its
  -- arrival, parked (its replica stalls)
  local entry = undo_offer(oid, off)
  redis.call('HSET', orders, oid, entry)
  local f = split(entry)
  redis.call('HSET', stall, f[4], now)
  park_order(oid, f[1], '-' .. f[2], f[4])
end

local function unpark(replica)
  -- the replica speaks again: its parked orders go back to their place
  if tonumber(redis.call('HGET', parkn, replica) or '0') <= 0 then return end
  local all = redis.call('ZRANGE', park, 0, -1, 'WITHSCORES')
  for i = 1, #all, 2 do
    local member = all[i]
    local oid = string.sub(member, 18)
    local o = redis.call('HGET', orders, oid)
    if not o then
      redis.call('ZREM', park, member)
    elseif split(o)[4] == replica then
      redis.call('ZREM', park, member)
      redis.call('ZADD', book, all[i + 1], member)
      redis.call('ZADD', lease, now + lease_ms, oid)
    end
  end
  redis.call('HDEL', parkn, replica)
end

local function revive(replica)
  -- ``replica`` called a script: it is alive
  local exp = redis.call('ZSCORE', reps, replica)
  if not exp or tonumber(exp) < now then redis.call('ZADD', reps, now + lease_ms, replica) end
  redis.call('HDEL', stall, replica)
  unpark(replica)
end

local function live(replica)
  if replica == caller then return true end
  local exp = redis.call('ZSCORE', reps, replica)
  return exp and tonumber(exp) >= now and redis.call('HEXISTS', stall, replica) == 0
end

local function sweep_parked()
  -- at most once a second: drop the parked orders of replicas presumed dead
  if redis.call('ZCARD', park) == 0 then return end
  if now - tonumber(redis.call('HGET', stats, 'swept') or '0') < 1000 then return end
  redis.call('HSET', stats, 'swept', now)
  for _, member in ipairs(redis.call('ZRANGE', park, 0, 255)) do
    local oid = string.sub(member, 18)
    local o = redis.call('HGET', orders, oid)
    if not o then
      redis.call('ZREM', park, member)
    else
      local exp = redis.call('ZSCORE', reps, split(o)[4])
      if not exp or tonumber(exp) + park_ms < now then drop(oid) end
    end
  end
end

local function prune()
  local expired = redis.call('ZRANGEBYSCORE', lease, '-inf', now, 'LIMIT', 0, 512)
  for _, oid in ipairs(expired) do
    local off = redis.call('HGET', offer, oid)
    if off then
      give_back(oid, off)
    elseif redis.call('HEXISTS', held, oid) == 1 then
      drop(oid)   -- a running slot whose replica went silent: free again
    else
      local o = redis.call('HGET', orders, oid)
      if o then
        local f = split(o)
        park_order(oid, f[1], '-' .. f[2], f[4])   -- its replica went silent: kept in place
      else
        redis.call('ZREM', lease, oid)
      end
    end
  end
  sweep_parked()
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

local function best_slot(bid, avoid)
  -- the cheapest free eligible deployment (ties: fewest busy), avoiding ``avoid``
  local best, k1, k2, k3, floor_s = nil, 0, 0, 0, nil
  for _, d in ipairs(deps) do
    local name, f = d[1], tonumber(d[2])
    local b = busy_of(name)
    if b < d[3] and f <= bid and cool_of(name) <= now then
      local a = (name == avoid) and 1 or 0
      if best == nil or a < k1 or (a == k1 and (f < k2 or (f == k2 and b < k3))) then
        best, k1, k2, k3, floor_s = name, a, f, b, d[2]
      end
    end
  end
  return best, floor_s
end

local function admit(oid, member, raw, best, floor_s)
  local o = split(raw)
  local bid_s, replica, attempt = o[2], o[4], o[5] or '0'
  local bid = tonumber(bid_s)
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
  local rec = now .. '|' .. price_s .. '|' .. bid_s .. '|' .. best
  redis.call('HSET', held, oid,
    best .. '|' .. replica .. '|' .. price_s .. '|' .. lvl .. '|' .. attempt .. '|' .. bid_s .. '|' .. (o[6] or ''))
  redis.call('HINCRBY', stats, 'admitted', 1)
  rec = rec .. '|' .. oid .. '|' .. attempt   -- which admission: FAILED finds it so
  redis.call('LPUSH', recent, rec)
  redis.call('LTRIM', recent, 0, 31)
  if oid == quiet then
    redis.call('ZADD', lease, now + lease_ms, oid)
  else
    -- an offer: its replica takes it up (TAKE) before the deadline, or it goes back
    redis.call('HSET', offer, oid, raw .. '#' .. rec)
    redis.call('ZADD', lease, now + take_ms, oid)
    redis.call('PUBLISH', chan .. replica,
      product .. '|' .. oid .. '|' .. best .. '|' .. price_s .. '|' .. lvl .. '|' .. attempt)
    offers = offers + 1
  end
end

local function dispatch()
  local n = 0
  while true do
    local top = redis.call('ZRANGE', book, 0, 0, 'WITHSCORES')
    if #top == 0 then break end
    local member = top[1]
    local oid = string.sub(member, 18)
    local raw = redis.call('HGET', orders, oid)
    if not raw then
      redis.call('ZREM', book, member)   -- never left stranded
    else
      local o = split(raw)
      if not live(o[4]) then
        park_order(oid, member, top[2], o[4])   -- nobody would take it up now
      else
        local best, floor_s = best_slot(tonumber(o[2]), o[3])
        if best == nil then break end
        admit(oid, member, raw, best, floor_s)
        n = n + 1
      end
    end
  end
  return n
end

local function admission_pace()
  -- {admissions in the recent list, ms from the oldest of them to now}
  local last = redis.call('LRANGE', recent, 0, 31)
  if #last == 0 then return {0, 0} end
  local oldest = tonumber(split(last[#last])[1])
  return {#last, now - oldest}
end

revive(caller)

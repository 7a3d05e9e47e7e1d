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
--                  by member, so by arrival)
--   orders  HASH   order_id -> 'member|bid|avoid|replica|attempt' (waiting orders)
--   held    HASH   order_id -> 'deployment|replica|price|level|attempt' (slots given;
--                  attempt tells a requeued order's admissions apart)
--   lease   ZSET   order_id -> lease expiry (ms); renewed by the owner's heartbeat
--   busy    HASH   deployment -> slots in use
--   cool    HASH   deployment -> cooling until (ms), set by a replica's breaker
--   stats   HASH   'admitted' -> admissions ever
--   recent  LIST   'ms|price|bid|deployment', newest first, 32 kept
--   seq     STRING arrival counter
--
-- and {prefix}:replicas (ZSET replica -> lease expiry, ms): an order whose replica
-- is gone is dropped rather than admitted.
--
-- Numbers that are prices travel as strings (repr of a float in, %.17g out) so no
-- precision is lost; the cleared price is always one of the bid, a floor or the
-- runner-up's bid, never computed.
--
-- ARGV[1..4] (every book script): deployments as JSON, lease (ms), the admission
-- channel prefix, the product; the script's own arguments follow from ARGV[5].

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

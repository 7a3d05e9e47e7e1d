-- ARGV[A..A+8]: order_id, bid, seq (0: new), avoid, replica, max_waiting, cool_for
-- (ms from now, 0: no), attempt, output cap ('': not known; the wait forecast's).
-- A requeue is a submit of an order that holds a slot: the slot is given back and
-- the order rests again with its arrival in the same step, so no later order of
-- equal bid can take its place in between.
local oid, bid_s, seq, avoid, replica = ARGV[A], ARGV[A + 1], tonumber(ARGV[A + 2]), ARGV[A + 3], ARGV[A + 4]
local h = redis.call('HGET', held, oid)
if h then cool_for(split(h)[1], tonumber(ARGV[A + 6] or '0')) end
drop(oid)   -- the slot of a requeued order, or an earlier life of it (a job resumed after a crash)
prune()
if redis.call('ZCARD', book) >= tonumber(ARGV[A + 5]) then
  dispatch()   -- a requeued order gave its slot back
  return out({'full'})
end
if seq == 0 then seq = next_seq() end
local member = string.format('%016d', seq) .. ':' .. oid
redis.call('ZADD', book, '-' .. bid_s, member)
redis.call('HSET', orders, oid,
  member .. '|' .. bid_s .. '|' .. avoid .. '|' .. replica .. '|' .. (ARGV[A + 7] or '0') .. '|' .. (ARGV[A + 8] or ''))
redis.call('ZADD', lease, now + lease_ms, oid)
local pos = redis.call('ZRANK', book, member)
quiet = oid
dispatch()
local rank = redis.call('ZRANK', book, member)
return out({'ok', string.format('%d', seq), pos, redis.call('HGET', held, oid) or '', rank or -1, level(),
  redis.call('ZCARD', book)})

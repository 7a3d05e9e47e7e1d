-- ARGV[A]: order_id. Takes a waiting order out; tells if it was admitted meanwhile
-- (an admission still on offer is taken up: the owner has it now).
local oid = ARGV[A]
local o = redis.call('HGET', orders, oid)
if o then
  drop(oid)
  prune()
  dispatch()
  return out({'removed'})
end
local h = redis.call('HGET', held, oid)
if h then
  if redis.call('HDEL', offer, oid) == 1 then redis.call('ZADD', lease, now + lease_ms, oid) end
  return out({'held', h})
end
return out({'gone'})

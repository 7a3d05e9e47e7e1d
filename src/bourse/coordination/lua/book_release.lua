-- ARGV[5]: order_id. Gives its slot back (a no-op if its lease already did).
local oid = ARGV[5]
local h = redis.call('HGET', held, oid)
if h then drop(oid) end
prune()
dispatch()
if h then return 1 end
return 0

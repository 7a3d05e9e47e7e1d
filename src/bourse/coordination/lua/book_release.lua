-- ARGV[A]: order_id. Gives its slot back (a no-op if its lease already did); an order
-- still waiting is taken out too (a replica forgetting what it gave up on while Redis
-- was unreachable).
local oid = ARGV[A]
local h = drop(oid)
prune()
dispatch()
if h then return out(1) end
return out(0)

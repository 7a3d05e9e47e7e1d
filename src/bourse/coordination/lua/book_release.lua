-- ARGV[A..]: order ids. Gives each one's slot back (a no-op if its lease already did);
-- an order still waiting is taken out too (a replica forgetting what it gave up on
-- while Redis was unreachable). The reply: how many held a slot.
local n = 0
for i = A, #ARGV do
  if drop(ARGV[i]) then n = n + 1 end
end
prune()
dispatch()
return out(n)

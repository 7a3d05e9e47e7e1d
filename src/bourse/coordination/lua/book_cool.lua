-- ARGV[A]: deployment; ARGV[A+1]: for how long (ms from now; 0 clears the cooling)
local dep, for_ms = ARGV[A], tonumber(ARGV[A + 1])
if for_ms == 0 then
  redis.call('HDEL', cool, dep)
else
  cool_for(dep, for_ms)
end
prune()
dispatch()
return out(1)

-- ARGV[A]: deployment; ARGV[A+1]: until (ms; 0 clears the cooling)
local dep, untilms = ARGV[A], tonumber(ARGV[A + 1])
if untilms == 0 then
  redis.call('HDEL', cool, dep)
else
  cool_until(dep, untilms)
end
prune()
dispatch()
return out(1)

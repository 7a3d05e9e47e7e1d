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

-- ARGV[5..]: the order ids this replica waits on or holds: renew their leases,
-- clear the book, and report each one ('w' rank | 'h' terms | 'g' gone)
for i = 5, #ARGV do
  if redis.call('ZSCORE', lease, ARGV[i]) then redis.call('ZADD', lease, now + lease_ms, ARGV[i]) end
end
prune()
dispatch()
local out = {level(), redis.call('ZCARD', book)}
for i = 5, #ARGV do
  local oid = ARGV[i]
  local o = redis.call('HGET', orders, oid)
  if o then
    out[#out + 1] = 'w' .. (redis.call('ZRANK', book, split(o)[1]) or -1)
  else
    local h = redis.call('HGET', held, oid)
    if h then out[#out + 1] = 'h' .. h else out[#out + 1] = 'g' end
  end
end
return out

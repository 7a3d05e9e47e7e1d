-- ARGV[A..]: what this replica waits on or holds, each 'w|order_id|seq|bid|avoid|attempt'
-- (waiting) or 'h|order_id|deployment|price|level|attempt|bid' (a slot it runs on).
-- Renews their leases; rests again a waiting order the book forgot (a Redis restart,
-- or parked too long) with its arrival; counts again a slot it forgot (busy may then
-- exceed the slots until one is given back); an admission still on offer is taken up.
-- Then clears the book and reports each one: 'w' rank | 'h' terms.
local function rest(oid, seq, bid_s, avoid, attempt)
  local member = string.format('%016d', tonumber(seq)) .. ':' .. oid
  redis.call('ZADD', book, '-' .. bid_s, member)
  redis.call('HSET', orders, oid, member .. '|' .. bid_s .. '|' .. avoid .. '|' .. caller .. '|' .. attempt)
end

for i = A, #ARGV do
  local f = split(ARGV[i])
  local oid = f[2]
  local h = redis.call('HGET', held, oid)
  if h then
    redis.call('HDEL', offer, oid)
  elseif f[1] == 'h' then
    redis.call('HSET', held, oid, f[3] .. '|' .. caller .. '|' .. f[4] .. '|' .. f[5] .. '|' .. f[6] .. '|' .. (f[7] or ''))
    redis.call('HINCRBY', busy, f[3], 1)
  elseif redis.call('HEXISTS', orders, oid) == 0 then
    rest(oid, f[3], f[4], f[5], f[6])
  end
  redis.call('ZADD', lease, now + lease_ms, oid)
end
prune()
dispatch()
local res = {level(), redis.call('ZCARD', book)}
for i = A, #ARGV do
  local oid = split(ARGV[i])[2]
  local o = redis.call('HGET', orders, oid)
  if o then
    res[#res + 1] = 'w' .. (redis.call('ZRANK', book, split(o)[1]) or -1)
  else
    local h = redis.call('HGET', held, oid)
    if h then res[#res + 1] = 'h' .. h else res[#res + 1] = 'g' end
  end
end
return out(res)

-- ARGV[A]: order_id; ARGV[A+1]: its attempt. That admission's run ended before any
-- output: its entry in the recent list is marked a failed attempt ('|x'), which the
-- views do not count as cleared. A no-op once the entry has left the list.
local tail = '|' .. ARGV[A] .. '|' .. ARGV[A + 1]
local entries = redis.call('LRANGE', recent, 0, 31)
for i, rec in ipairs(entries) do
  if string.sub(rec, -#tail) == tail then
    redis.call('LSET', recent, i - 1, rec .. '|x')
    return out(1)
  end
end
return out(0)

-- ARGV[A]: how many waiting bids to list
prune()
dispatch()
local res = {level(), redis.call('ZCARD', book), redis.call('HGET', stats, 'admitted') or '0'}
local b, c = {}, {}
for _, d in ipairs(deps) do
  b[#b + 1] = tostring(busy_of(d[1]))
  c[#c + 1] = tostring(cool_of(d[1]) - now)
end
res[4] = b
res[5] = c
local bids = {}
local top = redis.call('ZRANGE', book, 0, tonumber(ARGV[A]) - 1, 'WITHSCORES')
for i = 2, #top, 2 do bids[#bids + 1] = fmt(-tonumber(top[i])) end
res[6] = bids
res[7] = redis.call('LRANGE', recent, 0, 31)
res[8] = tostring(now)
res[9] = redis.call('ZCARD', park)
res[10] = redis.call('HGETALL', held)
return out(res)

-- KEYS: bucket hash, streams hash (replica -> count), replicas zset (replica -> lease ms)
-- ARGV: rpm, tpm, max_streams (-1: none), tokens, replica, ttl_ms
local k, sk, reps = KEYS[1], KEYS[2], KEYS[3]
local rpm, tpm, maxs, tokens, replica, ttl =
  tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local t = redis.call('TIME')
local nowms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now = nowms / 1000
local function fmt(x) return string.format('%.6f', x) end

local streams = 0
local all = redis.call('HGETALL', sk)
for i = 1, #all, 2 do
  local exp = redis.call('ZSCORE', reps, all[i])
  if exp and tonumber(exp) > nowms then
    streams = streams + tonumber(all[i + 1])
  else
    redis.call('HDEL', sk, all[i])   -- a replica that died holding streams
  end
end
if maxs >= 0 and streams >= maxs then return {0, 'streams', fmt(1), tostring(streams)} end

local function bucket(prefix, cap)
  local lv = tonumber(redis.call('HGET', k, prefix .. 'l') or '-1')
  local at = tonumber(redis.call('HGET', k, prefix .. 'a') or '0')
  local c = tonumber(redis.call('HGET', k, prefix .. 'c') or '-1')
  if lv < 0 or c ~= cap then return cap end
  if now > at then lv = math.min(cap, lv + (now - at) * cap / 60) end
  return lv
end

local rq, tk = nil, nil
if rpm >= 0 then
  rq = bucket('r', rpm)
  if rq < 1 then return {0, 'requests', fmt((1 - rq) * 60 / rpm), fmt(rq)} end
end
local need = 0
if tpm >= 0 then
  tk = bucket('t', tpm)
  need = math.min(tokens, tpm)
  if tk < need then return {0, 'tokens', fmt((need - tk) * 60 / tpm), fmt(tk)} end
end
if rq then
  rq = rq - 1
  redis.call('HSET', k, 'rl', fmt(rq), 'ra', fmt(now), 'rc', rpm)
end
if tk then
  tk = tk - need
  redis.call('HSET', k, 'tl', fmt(tk), 'ta', fmt(now), 'tc', tpm)
end
redis.call('PEXPIRE', k, ttl)
redis.call('HINCRBY', sk, replica, 1)
redis.call('PEXPIRE', sk, 86400000)
return {1, '', fmt(rq or -1), fmt(tk or -1)}

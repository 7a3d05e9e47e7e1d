-- KEYS: bucket hash, streams hash. ARGV: tpm (-1: none), tokens to give back, replica
local k, sk = KEYS[1], KEYS[2]
local tpm, back, replica = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local n = redis.call('HINCRBY', sk, replica, -1)
if n <= 0 then redis.call('HDEL', sk, replica) end
if tpm >= 0 and back > 0 then
  local lv = tonumber(redis.call('HGET', k, 'tl') or '-1')
  local c = tonumber(redis.call('HGET', k, 'tc') or '-1')
  if lv >= 0 and c == tpm then
    redis.call('HSET', k, 'tl', string.format('%.6f', math.min(tpm, lv + back)))
  end
end
return 1

-- ARGV[5]: order_id. Takes a waiting order out; tells if it was admitted meanwhile.
local oid = ARGV[5]
local o = redis.call('HGET', orders, oid)
if o then
  drop(oid)
  prune()
  dispatch()
  return {'removed'}
end
local h = redis.call('HGET', held, oid)
if h then return {'held', h} end
return {'gone'}

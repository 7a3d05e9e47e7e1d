-- ARGV[A]: order_id, ARGV[A+1]: attempt, ARGV[A+2]: '1' take the admission up, '0'
-- decline it (the client left): the slot goes to the next order, the order is out.
-- Reply: {'taken', held terms} | {'declined'} | {'back'} (the offer went back before
-- it was taken: the order waits in its place again) | {'gone'}
local oid, attempt, accept = ARGV[A], ARGV[A + 1], ARGV[A + 2] == '1'
local h = redis.call('HGET', held, oid)
local reply
if h and split(h)[5] == attempt then
  if accept then
    redis.call('HDEL', offer, oid)
    redis.call('ZADD', lease, now + lease_ms, oid)
    reply = {'taken', h}
  else
    local off = redis.call('HGET', offer, oid)
    if off then undo_offer(oid, off) end   -- no admission: the client had left
    drop(oid)
    reply = {'declined'}
  end
elseif redis.call('HEXISTS', orders, oid) == 1 then
  if accept then reply = {'back'} else drop(oid); reply = {'declined'} end
else
  reply = {'gone'}
end
prune()
dispatch()
return out(reply)

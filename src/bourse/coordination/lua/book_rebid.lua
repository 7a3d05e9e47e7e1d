-- ARGV[A]: order_id, ARGV[A+1]: its new bid (a raise: the caller checked it against the
-- order's bid and ceiling). A deadline order's raise: a waiting order (in the book, or
-- parked) is scored at its new bid under the same member, so it keeps its arrival:
-- it passes the lower bids and stays behind the equal bids that came before it. Then
-- the book is cleared (an admission this raise earns is offered on the channel, as
-- any other). An order already admitted keeps the bid it cleared at: one step, so an
-- order is never both raised in the book and admitted.
-- Reply: {'raised', rank (-1: admitted by this clear, or parked)} | {'held'} | {'gone'}
local oid, bid_s = ARGV[A], ARGV[A + 1]
local reply
prune()
local o = redis.call('HGET', orders, oid)
if o then
  local f = split(o)
  local member = f[1]
  if tonumber(bid_s) > tonumber(f[2]) then
    f[2] = bid_s
    redis.call('HSET', orders, oid, table.concat(f, '|'))
    if redis.call('ZSCORE', book, member) then
      redis.call('ZADD', book, '-' .. bid_s, member)
    elseif redis.call('ZSCORE', park, member) then
      redis.call('ZADD', park, '-' .. bid_s, member)
    end
  end
  dispatch()
  reply = {'raised', redis.call('ZRANK', book, member) or -1}
else
  dispatch()
  if redis.call('HEXISTS', held, oid) == 1 then reply = {'held'} else reply = {'gone'} end
end
return out(reply)

-- ARGV[A]: a book member ('' for none): the level, the orders ahead of it, and the
-- admission pace {admissions, over ms}; clears first (a sweep after an offer's deadline)
prune()
dispatch()
local rank = -1
if ARGV[A] ~= '' then rank = redis.call('ZRANK', book, ARGV[A]) or -1 end
local pace = admission_pace()
return out({level(), rank, pace[1], pace[2]})
